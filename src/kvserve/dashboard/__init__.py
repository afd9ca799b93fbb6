"""The live dashboard: the engine's state, streamed to a page that draws the scheduler at work.

``state.py`` defines one frame of that state (shared by the live stream and
the trace replay) and ``rolling.py`` its rolling figures; ``sampler.py``
takes frames on the engine's loop thread, ``hub.py`` fans them out to
browsers, ``page.py`` serves the page (``static/``), ``live.py`` the live
routes and ``load.py`` the page's "send load" button. ``replay.py`` turns a
recorded step trace into frames, ``replay_app.py`` serves them and
``cli.py`` is ``kvserve dashboard --trace FILE``.
"""
