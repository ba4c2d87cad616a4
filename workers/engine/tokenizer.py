"""Tokenizer, chat template and incremental detokenizer, all from the model's own files.

A GGUF file carries its vocabulary as metadata (``tokenizer.ggml.*``); a Hugging Face folder carries
``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja`` for the template). Either
way the result is a ``tokenizers.Tokenizer`` plus the chat template, rendered in a sandbox because
it is code that came with someone else's weights.
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokenizers import AddedToken, Encoding, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .config import UnsupportedModelError, WeightsError

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The chat template is missing, or refused the messages (its ``raise_exception``)."""


# How byte-level BPE vocabularies split text into words before merging, by llama.cpp's
# ``tokenizer.ggml.pre`` name. Unknown names fall back to GPT-2's own split (ByteLevel's regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies trained on single digits (GPT-2 split, but every digit its own word).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact"}
# Vocabularies whose whole words win over the merges (llama.cpp's ignore_merges).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}
_GPT2_NAMES = {None, "default", "gpt2", *(_DIGIT_SPLIT), *_SPLITS}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Put after the first character of a control token's text written in a message, so that the
# rendered prompt holds no such text but the template's own (taken out again before encoding).
_MARK = "\ue000"  # a private-use character
_MARKS = re.compile(_MARK + "(" + _MARK + ")?")  # a doubled mark is a mark the message itself held


class Tokenizer:
    """Text ↔ token ids, and the chat template, for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
        special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        # bos_token, eos_token, ... as text, which chat templates refer to.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = None
        self._control = _control_token_pattern(backend)  # None: the vocabulary has none
        self._as_text = None  # a copy of the backend that reads control tokens' text as plain text
        self._byte_level = "ByteLevel" in repr(backend.decoder)  # GPT-2 style pieces (else "▁" pieces)
        self._token_bytes: dict[int, bytes] = {}
        self._byte_table: list[bytes | None] | None = None

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        kind = metadata.get("tokenizer.ggml.model")
        tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
        if kind == "gpt2":
            backend = _byte_level_bpe(metadata, tokens)
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(metadata, tokens)
            add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise UnsupportedModelError(
                f"unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2', "
                f"sentencepiece BPE 'llama')")

        types = list(metadata.get("tokenizer.ggml.token_type") or ())
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == _CONTROL])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _USER_DEFINED])

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos_id is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
                special_tokens=[(tokens[bos_id], bos_id)])
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos,
            chat_template=metadata.get("tokenizer.chat_template"),
            special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                            "unk_token": token("unknown_token_id"),
                            "pad_token": token("padding_token_id")},
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path, *, extra_eos_token_ids: Iterable[int] = ()
                       ) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise WeightsError(f"{folder} has no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:
            raise WeightsError(f"{path.name} cannot be read: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        special = {name: _token_text(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos = list(extra_eos_token_ids)
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos.append(backend.token_to_id(special["eos_token"]))
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos, chat_template=template,
                   special_tokens=special)

    # -- using ---------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are kept
        whole; ``add_special_tokens`` adds what the model wants around a text (e.g. BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, not {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat prompt, with the model's own additions (e.g. BOS). Only the
        template writes control tokens: a message that spells one (``<|im_end|>``) gets it as
        text, as OpenAI treats message content, so that a user cannot end their turn or forge
        another role's. Without such text the ids are exactly those of the rendered prompt."""
        if self._control is None or not any(isinstance(m.get("content"), str) and self._control.search(m["content"])
                                            for m in messages):
            # The usual case, encoded whole: the tokenizer's own rules around control tokens (the
            # whitespace some strip, sentencepiece's first-word space) apply as they always did.
            return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                               add_special_tokens=True)
        # A message spells a control token: encode the text between the template's own ones as
        # text, piece by piece (around those, a tokenizer's whitespace rules may differ slightly).
        escaped = [{**m, "content": self._escape(m["content"])} if isinstance(m.get("content"), str) else m
                   for m in messages]
        prompt = self.apply_chat_template(escaped, add_generation_prompt=add_generation_prompt)
        if self._as_text is None:
            as_text = BackendTokenizer.from_str(self.backend.to_str())
            as_text.encode_special_tokens = True
            self._as_text = as_text
        pieces = []
        for i, part in enumerate(self._control.split(prompt)):  # odd parts: the template's control tokens
            if i % 2:
                pieces.append(self.backend.encode(part, add_special_tokens=False))
            elif part:
                pieces.append(self._as_text.encode(_MARKS.sub(lambda m: m.group(1) or "", part),
                                                   add_special_tokens=False))
        merged = Encoding.merge(pieces) if pieces else self.backend.encode("", add_special_tokens=False)
        return self.backend.post_process(merged, add_special_tokens=True).ids

    def _escape(self, text: str) -> str:
        text = text.replace(_MARK, _MARK * 2)
        for _ in range(8):  # control tokens whose text overlaps itself need another pass
            escaped = self._control.sub(lambda m: m.group(0)[0] + _MARK + m.group(0)[1:], text)
            if escaped == text:
                break
            text = escaped
        return text

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own: part of a UTF-8 character for some (which
        decoding it alone turns into U+FFFD), a leading space for a sentencepiece "▁word". What
        OpenAI's logprobs report as ``bytes``, so that clients can put characters back together."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._bytes_of(int(token_id))
        return cached

    def _bytes_of(self, token_id: int) -> bytes:
        return _piece_bytes(self.backend.id_to_token(token_id) or "", byte_level=self._byte_level)

    def byte_table(self) -> list[bytes | None]:
        """Every token's bytes, by id; None for control tokens, which are never generated text."""
        if self._byte_table is None:
            control = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
            self._byte_table = [None if i in control else self._bytes_of(i)
                                for i in range(self.backend.get_vocab_size(with_added_tokens=True))]
        return self._byte_table

    def detokenizer(self) -> "IncrementalDetokenizer | ByteLevelDetokenizer":
        """A new request's incremental detokenizer: a table lookup per token where the vocabulary
        decodes byte-level (GPT-2, Llama 3, Qwen, SmolLM), else windowed decoding."""
        table = self.text_bytes()
        return IncrementalDetokenizer(self) if table is None else ByteLevelDetokenizer(table)

    def text_bytes(self) -> list[bytes] | None:
        """Each token's bytes as decoding adds them (empty for a control token, which decoding
        skips), where decoding is only joining them; None where it is more (a sentencepiece
        "▁" joined into words, or a vocabulary whose added tokens decode otherwise)."""
        return self._text_bytes

    @functools.cached_property
    def _text_bytes(self) -> list[bytes] | None:
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        table = self.byte_table()
        if max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1) >= len(table):
            return None  # ids with holes between them: the table, by id, would miss some
        # Added tokens are written as they are, which may not be their bytes the byte-level way.
        added = self.backend.get_added_tokens_decoder()
        if any((table[i] or b"").decode("utf-8", "replace") != self.decode([i]) for i in added):
            return None
        return [piece or b"" for piece in table]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...])."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is code: any failure is the caller's messages' fault
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def _control_token_pattern(backend: BackendTokenizer) -> re.Pattern | None:
    """A pattern matching the text of the vocabulary's control (special) tokens, the longest first,
    captured (so that ``split`` keeps them); None when it has none."""
    texts = sorted({token.content for token in backend.get_added_tokens_decoder().values()
                    if token.special and token.content}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(t) for t in texts) + ")") if texts else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never cutting a UTF-8 character in half.

    Byte-level tokens can end mid-character; decoding then yields U+FFFD, so the text is held back
    until a later token completes it. Decoding a short window that starts at already-emitted tokens
    keeps tokenizers that drop a leading space on the first token (sentencepiece) correct.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window (already emitted)
        self._read = 0  # end of what has been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read])
        after = decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer`` for a byte-level vocabulary, where a text's bytes are its tokens'
    bytes joined: a table lookup and an incremental UTF-8 decode per token, which holds back a
    character's first bytes until the token that completes it, instead of two decodes of a
    window (about 1.4 µs a token against 5; the decodes were a third of the loop's hand-out at a
    batch of 256, ``bench/engine_loop.py``)."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # U+FFFD as decoding writes it
        self._pieces: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        token_id = int(token_id)
        raw = self._table[token_id] if 0 <= token_id < len(self._table) else b""  # a padding id: nothing
        piece = self._utf8.decode(raw)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        return "".join(self._pieces)


# -- helpers -----------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, from character to byte: printable bytes stand for themselves,
    the others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _piece_bytes(piece: str, *, byte_level: bool) -> bytes:
    # A sentencepiece byte-fallback token (a byte-level vocabulary's decoder writes such a piece as it is).
    if not byte_level and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    if byte_level and all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return (piece if byte_level else piece.replace("\u2581", " ")).encode("utf-8")  # special tokens as written


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    """GPT-2 style: byte-level alphabet, merges stored in the file, a split regex by pre name."""
    merges = list(metadata.get("tokenizer.ggml.merges") or ())
    if not tokens or not merges:
        raise WeightsError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in _GPT2_NAMES:
        log.warning("unknown GGUF pre-tokenizer %r; splitting words the GPT-2 way", pre)
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    """Llama 2 / Mistral style: "▁" for spaces, <0xNN> byte tokens for anything unknown, and
    merges implied by the pieces' scores (the file stores scores, not merges)."""
    scores = list(metadata.get("tokenizer.ggml.scores") or ())
    if not tokens or len(scores) != len(tokens):
        raise WeightsError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.scores")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges_from_scores(vocab, scores)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None)
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every way to build a piece from two others, best-scored pieces first (then longer left
    halves), which is the order sentencepiece's BPE merges them in."""
    candidates = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[index], -len(left), -len(right), index, vocab[left],
                                   left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise WeightsError(f"{path.name} is not valid JSON: {exc}") from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}, as older tokenizer_config.json files write
        return value.get("content")
    return value
