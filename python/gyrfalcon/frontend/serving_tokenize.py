"""POST /tokenize and /detokenize (vLLM's routes): the served tokenizer, over HTTP.

Chat-style bodies go through `render_chat_prompt`, the function that makes a
chat completion's prompt, so /tokenize reports exactly the ids a chat
completion would send to the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyrfalcon.frontend.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from gyrfalcon.frontend.serving_chat import render_chat_prompt
from gyrfalcon.frontend.serving_common import RequestError, ServingContext

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Any text the tokenizer encodes to at least one id: it shows where the special
# tokens go around a text's ids.
SPECIAL_TOKENS_PROBE = "a"


def create_tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    """The ids of a prompt or of a rendered chat, with the context length.

    503 while the engine is not ready: `max_model_len` is the engine's.
    """
    ctx.check_model(req.model)
    ctx.check_engine()
    tokenizer = ctx.tokenizer
    if isinstance(req, TokenizeChatRequest):
        tools = [t.to_template() for t in req.tools] if req.tools else None
        ids = render_chat_prompt(tokenizer, req.messages, req.chat_template_kwargs, tools)
        if req.add_special_tokens:
            prefix, suffix = special_token_affixes(tokenizer)
            ids = prefix + ids + suffix
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=ctx.max_model_len,
        tokens=ids,
        token_strs=tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    )


def create_detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    """The tokenizer's decode of the ids, special tokens included (as vLLM does)."""
    ctx.check_model(req.model)
    ctx.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))


def special_token_affixes(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids `encode(text, add_special_tokens=True)` puts before and after the
    ids of `text` itself: ([BOS], []) for Llama's tokenizers, ([], []) for SmolLM2's.

    NOTE: a chat is rendered to text and encoded without special tokens, and
    transformers has no call that adds them to given ids. A tokenizer's
    single-text post-processor only puts fixed ids around the text's ids, so the
    wrapping seen on a probe is the wrapping of any text.
    """
    plain = tokenizer.encode(SPECIAL_TOKENS_PROBE, add_special_tokens=False)
    full = tokenizer.encode(SPECIAL_TOKENS_PROBE, add_special_tokens=True)
    n = len(plain)
    for start in range(len(full) - n + 1):
        if full[start : start + n] == plain:
            return full[:start], full[start + n :]
    raise RequestError(
        "this tokenizer's special tokens cannot be added to a rendered chat",
        param="add_special_tokens",
    )
