"""Jinja templates rendered under limits of work, size and time.

Chat templates come with model files, and model files may be hostile. This
package renders a template in Jinja's immutable sandbox with every piece of
its work charged to a budget (:class:`TemplateLimits`): a template that loops
for ever, builds gigabytes or runs for minutes is stopped by a
:class:`TemplateLimitError` in the thread that renders it.
"""

from kvserve.chat.bounded_jinja.limits import (
    LIMITS_ENV,
    TemplateLimitError,
    TemplateLimits,
    limits_from_env,
    parse_limits,
)
from kvserve.chat.bounded_jinja.render import compile_template, render_template

__all__ = [
    "LIMITS_ENV",
    "TemplateLimitError",
    "TemplateLimits",
    "compile_template",
    "limits_from_env",
    "parse_limits",
    "render_template",
]
