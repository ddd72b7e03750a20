"""How a task's prompt text becomes the token ids the engine completes: ``model.prompt_format``.

    model.prompt_format._target_=modules.policy.prompt_format.PlainText      # the tiny model
    model.prompt_format._target_=modules.policy.prompt_format.ChatTemplate   # a chat model

The format belongs to the model: a base model completes the task's text as it is; a chat model
was trained on its chat template, so the text becomes the user turn of a conversation (after
the template's system turn) and generation starts at the assistant's header. Every place that
turns a prompt into ids (rollout, held-out evaluation, start-up checks, the SFT warm start)
goes through ``ids``; multi-turn episodes append an observation as ``observation`` renders it
(for a chat model: the template's tool turn, then the next assistant header).

Why rendered text is tokenised with ``add_special_tokens=False``: the template writes its own
special tokens (SmolLM2's ``<|im_start|>``, which its tokenizer also names as BOS); letting the
tokenizer add a BOS as well would give the model a context it never saw in training.
"""

from __future__ import annotations

from typing import Any

from modules.config.errors import ConfigError

# Sentinels rendered in place of an assistant turn and an observation to cut the template's
# text around them (no template escapes or rewrites these characters).
_ASSISTANT = "\u2063ASSISTANT\u2063"
_OBSERVATION = "\u2063OBSERVATION\u2063"


class PlainText:
    """The task's text is the model's context as it is (a base model; the character model)."""

    def render(self, tokenizer: Any, text: str) -> str:
        return text

    def ids(self, tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    def many_ids(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        """``ids`` of many texts in one tokenizer call (start-up checks over a whole split)."""
        return [list(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []

    def observation(self, tokenizer: Any, text: str) -> str:
        """A multi-turn observation is appended as it is."""
        return text

    def check(self, tokenizer: Any, model_path: str) -> None:
        """Nothing to check: any tokenizer completes plain text."""


class ChatTemplate:
    """The task's text is the user turn, rendered with the tokenizer's chat template.

    ``system``: the system turn's text; null keeps the template's own default (SmolLM2 writes
    "You are a helpful AI assistant named SmolLM, ..." when a conversation has none), "" gives
    an empty system turn. ``tool_role``: the role of an observation's turn in a multi-turn
    episode (``tool`` for ChatML templates; ``user`` for templates without a tool role)."""

    def __init__(self, system: str | None = None, tool_role: str = "tool") -> None:
        if system is not None and not isinstance(system, str):
            raise ConfigError(
                f"invalid config value model.prompt_format.system={system!r}: must be null "
                "(the template's default) or a string"
            )
        if not isinstance(tool_role, str) or not tool_role:
            raise ConfigError(
                f"invalid config value model.prompt_format.tool_role={tool_role!r}: must be a role "
                "name the chat template renders (tool, user)"
            )
        self.system = system
        self.tool_role = tool_role
        self._turns: dict[str, tuple[str, str]] = {}  # per chat template: the tool turn's text

    def messages(self, text: str) -> list[dict[str, str]]:
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*head, {"role": "user", "content": text}]

    def render(self, tokenizer: Any, text: str) -> str:
        return tokenizer.apply_chat_template(self.messages(text), tokenize=False, add_generation_prompt=True)

    def ids(self, tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(self.render(tokenizer, text), add_special_tokens=False)["input_ids"])

    def many_ids(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        """``ids`` of many texts in one tokenizer call (start-up checks over a whole split)."""
        rendered = [self.render(tokenizer, t) for t in texts]
        return (
            [list(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]] if texts else []
        )

    def observation(self, tokenizer: Any, text: str) -> str:
        """What follows a model turn that called a tool: the text the template puts between
        the assistant's content and the tool's (closing the assistant turn), the tool turn,
        and the next assistant header. Cut from the template's own rendering of a conversation,
        so it is exactly what re-rendering the whole conversation would write there."""
        between, after = self._tool_turn(tokenizer)
        return between + text + after

    def _tool_turn(self, tokenizer: Any) -> tuple[str, str]:
        cached = self._turns.get(tokenizer.chat_template)
        if cached is not None:
            return cached
        conversation = [
            *self.messages("x"),
            {"role": "assistant", "content": _ASSISTANT},
            {"role": self.tool_role, "content": _OBSERVATION},
        ]
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if text.count(_ASSISTANT) != 1 or text.count(_OBSERVATION) != 1:
            raise ConfigError(
                f"invalid config value model.prompt_format.tool_role={self.tool_role!r}: the chat "
                "template does not render a tool turn with this role as plain text"
            )
        between = text.split(_ASSISTANT, 1)[1].split(_OBSERVATION, 1)[0]
        after = text.split(_OBSERVATION, 1)[1]
        self._turns[tokenizer.chat_template] = (between, after)
        return between, after

    def check(self, tokenizer: Any, model_path: str) -> None:
        """Start-up: the tokenizer has a chat template, and it renders this format's turns."""
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"invalid config value model.prompt_format=ChatTemplate: the tokenizer of {model_path} "
                "has no chat template (a base model): use plain text (model.prompt_format._target_="
                "modules.policy.prompt_format.PlainText ~model.prompt_format.system "
                "~model.prompt_format.tool_role), or a chat model"
            )
        try:
            rendered = self.render(tokenizer, _OBSERVATION)
        except Exception as e:  # a template that rejects the roles it is given (e.g. a system turn)
            raise ConfigError(
                f"invalid config value model.prompt_format.system={self.system!r}: the chat template "
                f"of {model_path} cannot render it ({e})"
            ) from e
        if _OBSERVATION not in rendered:
            raise ConfigError(
                f"invalid config value model.prompt_format: the chat template of {model_path} "
                "does not write the user's text into the prompt"
            )
