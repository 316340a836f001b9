"""Structured output: the grammar a request's output must follow (xgrammar).

`spec.py` turns a request's `StructuredOutput` into an xgrammar `Grammar` (the
frontend builds it once to reject a bad schema with a 400; the worker builds it
again to compile it against the tokenizer). The worker's per-request matchers and
token bitmasks live in worker/grammar_state.py.
"""
