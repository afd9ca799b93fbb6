"""The live dashboard: the engine's state, streamed to a page that draws the scheduler at work.

``state.py`` defines one frame of that state (shared by the live stream and
the trace replay), ``sampler.py`` takes frames on the engine's loop thread,
``hub.py`` fans them out to browsers, ``routes.py`` serves the page and the
stream, ``load.py`` is the page's "send load" button, and ``replay.py`` turns
a recorded step trace into frames for ``kvserve dashboard --trace``.
"""
