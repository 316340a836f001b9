"""vLLM's tokenizer routes: the bodies and replies of POST /tokenize and /detokenize.

A tokenize body has one of two shapes, as in vLLM: completion-style (`prompt`)
or chat-style (`messages`, rendered through the chat template exactly as
/v1/chat/completions renders them). Whether `messages` is present picks the
shape (`TokenizeRequest`). The defaults are vLLM's: special tokens are added to
a prompt, but not to a rendered chat, whose template writes its own.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from gyrfalcon.frontend.protocol import ChatMessage, ParamError, _Body
from gyrfalcon.frontend.protocol_tools import ToolParam


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    honoured: ClassVar[frozenset[str]] = frozenset({"tools"})

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolParam] | None = None  # rendered into the prompt, as chat's are
    add_generation_prompt: bool = True
    # leave the last message open, so that the model continues it (HF's flag)
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_shape(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt") is not None:
            raise ParamError("prompt", "send either `prompt` or `messages`, not both")
        return data

    @model_validator(mode="after")
    def _check_flags(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true "
                "(add_generation_prompt defaults to true: set it to false)",
            )
        return self

    @property
    def chat_template_kwargs(self) -> dict[str, bool]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


PROMPT_SHAPE, CHAT_SHAPE = "tokenize:prompt", "tokenize:chat"
# the union's tags: pydantic puts them in an error's location, where no field has them
UNION_TAGS = frozenset({PROMPT_SHAPE, CHAT_SHAPE})


def _shape(body: Any) -> str:
    return CHAT_SHAPE if isinstance(body, dict) and "messages" in body else PROMPT_SHAPE


# NOTE: a callable discriminator: the body is validated as the one shape it has (a
# plain union reports every member's errors, the field named in none of them), and
# /openapi.json lists both shapes
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag(PROMPT_SHAPE)]
    | Annotated[TokenizeChatRequest, Tag(CHAT_SHAPE)],
    Discriminator(_shape),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's token strings, when asked


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
