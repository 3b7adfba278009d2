"""Chat-template arithmetic for the per-episode layout.

In a per-episode sample the model sees one growing token sequence: its first prompt, its action,
the environment's reply, its next action, ... The action tokens are the sampler's own ids; only the
text the *environment* adds is tokenized here. That text is what the chat template puts between the
end of the model's answer and the start of the next generation: the end-of-message marker the model
did not generate, the new user message(s) and the next assistant header.
"""

from __future__ import annotations

from typing import Any


class TemplateError(ValueError):
    """The chat template is not append-only, so a per-episode sequence cannot be built from it."""


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat template applied to ``messages`` as text."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def env_tokens_between(
    tokenizer: Any,
    messages_before: list[dict[str, str]],
    response_text: str,
    new_messages: list[dict[str, str]],
    response_ended_with_eos: bool,
) -> list[int]:
    """Token ids the environment contributes between a response and the next generation.

    ``messages_before`` produced the prompt of the response; ``new_messages`` (usually one user
    message with the observation) follow the assistant's answer. When the sampler stopped on the EOS
    token, that token is already among the response ids and is not repeated here.
    """
    opened = render(tokenizer, messages_before, add_generation_prompt=True)
    with_answer = [*messages_before, {"role": "assistant", "content": response_text}]
    closed = render(tokenizer, with_answer, add_generation_prompt=False)
    if not closed.startswith(opened + response_text):
        raise TemplateError(
            "the chat template does not render the assistant answer verbatim after the generation prompt; "
            "use sample_layout: per_turn with this tokenizer"
        )
    tail = closed[len(opened) + len(response_text) :]
    eos = getattr(tokenizer, "eos_token", None)
    if response_ended_with_eos and eos and tail.startswith(eos):
        tail = tail[len(eos) :]
    following = render(tokenizer, with_answer + list(new_messages), add_generation_prompt=True)
    if not following.startswith(closed):
        raise TemplateError("the chat template rewrites earlier messages when new ones are added (not append-only)")
    return [int(t) for t in tokenizer.encode(tail + following[len(closed) :], add_special_tokens=False)]
