"""A conversation to a prompt, through a chat template that may be hostile.

``encode`` (token ids, where only the template writes control tokens),
``render`` (the text, under limits; the check of a model's template at load),
``bounded_jinja/`` (the sandbox that charges a template's work to a budget).
Plain Python over strings and a tokenizer: the loader checks a model's
template with it, and every surface that takes chat messages encodes them.
"""
