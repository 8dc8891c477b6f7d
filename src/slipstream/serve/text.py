"""Text in and out of a served model: its tokenizer, incremental detokenizing, stop strings.

Two codecs share one small interface (`encode`, `decode`, `chat`, `eos_ids`, `pad_id`):
`ByteCodec` for the built-in byte-level GPT, `HFCodec` over a local transformers tokenizer.

Streaming text cannot be cut per token: a byte-level BPE token may end inside a UTF-8 character,
and a stop string may arrive split over tokens. `Detokenizer` re-decodes the generated ids and
releases only text that can no longer change (not ending in U+FFFD); `StopMatcher` holds back the
longest tail that could still begin a stop string, and cuts the text at the first stop found.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..recipe import RecipeError
from ..workloads.corpus import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID


class ByteCodec:
    """The built-in corpus's tokens: BOS, then the UTF-8 bytes."""

    eos_ids: tuple[int, ...] = (EOS_ID,)
    pad_id = PAD_ID
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t for t in ids if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """One token as text, special tokens named (for log-probability listings)."""
        if token < BYTE_VOCAB:
            return bytes([token]).decode("utf-8", errors="replace")
        return {BOS_ID: "<bos>", EOS_ID: "<eos>", PAD_ID: "<pad>"}.get(token, f"<{token}>")

    def chat(self, messages: list[dict]) -> list[int]:
        raise RecipeError("this model has no chat template; use /v1/completions")


class HFCodec:
    """A transformers tokenizer loaded from the model's folder."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], pad_id: int):
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as text, special tokens included (for log-probability listings)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise RecipeError(
                "this model's tokenizer has no chat template; use /v1/completions, or add "
                "'chat_template' to tokenizer_config.json"
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes its own special tokens (BOS included) as text.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class Detokenizer:
    """Generated ids -> text deltas that will not change as more tokens arrive."""

    def __init__(self, codec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the next token
        delta, self.text = text[len(self.text) :], text
        return delta


class StopMatcher:
    """Cuts text at the first stop string; never releases text a stop string could still claim."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # received, not yet released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text that is safe to release after `delta` arrived ('' once stopped)."""
        if self.stopped:
            return ""
        self.pending += delta
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
