"""System and developer messages after the first, where the chat template can take them.

Coding agents put system messages mid-conversation: Claude Code its `# Environment` block after the
first user message (kept in that place on later turns), OpenAI clients a late `developer` message.
Moving them to the front would change the prompt's start on every turn and lose the prefix cache, so
each stays where it stands:

- in place, as a system turn, when the family's chat template renders one there (probed once per
  template: a system message between a user and an assistant turn, and one last, each come out once
  and in order; several leading ones, likewise);
- otherwise folded into the neighbouring user turn inside SYSTEM_WRAPPER: the user message just
  before it, else the one just after it, else a user turn of its own. Leading system messages
  (several before the first other message) are joined into one system message first.

Both keep turn N's prompt a prefix of turn N+1's: a message is placed by what stands next to it, and
later turns only append. How each was placed is counted in `SystemPlacement` (the trace says it).
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_WRAPPER = "<system>\n{text}\n</system>"  # how a folded system message reads inside a user turn
_ROLE = "system"


@dataclass(frozen=True, slots=True)
class SystemPlacement:
    """System messages after the first other message of a prompt (the leading ones are the system
    prompt): rendered as system turns where they stand, or folded into a user turn beside them."""

    num_in_place: int = 0
    num_wrapped: int = 0

    @property
    def header_value(self) -> str:
        """`in_place=1` / `wrapped=2` (both when both happened); "" when there were none."""
        parts = [f"in_place={self.num_in_place}"] * bool(self.num_in_place)
        return "; ".join(parts + [f"wrapped={self.num_wrapped}"] * bool(self.num_wrapped))


class SystemTurns:
    """One template's way with later system messages, probed once."""

    def __init__(self, render):
        """`render(messages)`: the template's text of a conversation (with the generation prompt)."""
        self.in_place = _renders_in_order(render, ["u", _ROLE, "a", "v"]) and _renders_in_order(render, ["u", _ROLE])
        self.leading_in_place = _renders_in_order(render, [_ROLE, _ROLE, "u"])

    def fit(self, messages: list[dict]) -> tuple[list[dict], SystemPlacement]:
        """The template messages with every later system message placed (see the module's rules)."""
        out = messages if self.leading_in_place else _join_leading(messages)
        leading = _num_leading(out)
        later = sum(m["role"] == _ROLE for m in out[leading:])
        if not later:
            return out, SystemPlacement()
        if self.in_place:
            return out, SystemPlacement(num_in_place=later)
        return _fold(out, leading), SystemPlacement(num_wrapped=later)


def _renders_in_order(render, roles: list[str]) -> bool:
    """Whether the template renders these turns (user text 'u'/'v', assistant 'a', system) with each
    message's text once and in order."""
    texts = [f"probe-{index}-{role}" for index, role in enumerate(roles)]
    kinds = {"u": "user", "v": "user", "a": "assistant", _ROLE: _ROLE}
    messages = [{"role": kinds[role], "content": text} for role, text in zip(roles, texts)]
    try:
        rendered = render(messages)
    except Exception:  # noqa: BLE001 - a template refusing the order (raise_exception) is the answer
        return False
    places = [rendered.find(text) for text in texts]
    return all(rendered.count(text) == 1 for text in texts) and places == sorted(places) and -1 not in places


def _num_leading(messages: list[dict]) -> int:
    count = 0
    while count < len(messages) and messages[count]["role"] == _ROLE:
        count += 1
    return count


def _join_leading(messages: list[dict]) -> list[dict]:
    """Consecutive system messages at the start joined into one (they stay at the front, in order)."""
    count = _num_leading(messages)
    if count < 2:
        return messages
    text = "\n\n".join(_text(message) for message in messages[:count])
    return [{"role": _ROLE, "content": text}, *messages[count:]]


def _fold(messages: list[dict], leading: int) -> list[dict]:
    """Every system message after the first `leading` ones folded into a user turn beside it: the
    user message just before it, else the next one, else a user turn of its own."""
    out = list(messages[:leading])
    pending: list[str] = []  # wrapped texts waiting for the next user turn
    for message in messages[leading:]:
        if message["role"] == _ROLE:
            wrapped = SYSTEM_WRAPPER.format(text=_text(message))
            if out and out[-1]["role"] == "user" and not pending:
                out[-1] = _with_text(out[-1], wrapped, before=False)
            else:
                pending.append(wrapped)
            continue
        if pending and message["role"] == "user":
            message = _with_text(message, "\n\n".join(pending), before=True)
        elif pending:
            out.append({"role": "user", "content": "\n\n".join(pending)})
        pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _with_text(message: dict, text: str, before: bool) -> dict:
    """The message with `text` first or last in its content, a blank line between."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": text + "\n\n" + content if before else content + "\n\n" + text}
    if before:
        return {**message, "content": [{"type": "text", "text": text + "\n\n"}, *content]}
    return {**message, "content": [*content, {"type": "text", "text": "\n\n" + text}]}


def _text(message: dict) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)
