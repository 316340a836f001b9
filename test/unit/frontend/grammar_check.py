"""Which texts a request's StructuredOutput accepts, read by an xgrammar matcher
over a one-character-per-token vocabulary (no model, no tokenizer files)."""

from __future__ import annotations

import xgrammar as xgr

from gyrfalcon.grammar.spec import build_grammar
from gyrfalcon.ipc.messages import StructuredOutput


def accepted(so: StructuredOutput, texts: list[str]) -> list[bool]:
    """Per text: whether the grammar takes it whole, and ends there."""
    vocab = sorted(set("".join(texts)) | {" "})
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab)).compile_grammar(build_grammar(so))
    out = []
    for text in texts:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        ok = all(matcher.accept_token(vocab.index(ch)) for ch in text)
        out.append(ok and matcher.is_terminated())
    return out
