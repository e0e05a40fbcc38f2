"""Tokenizers behind one interface: `encode`, `decode`, `bos_token_id` / `eos_token_id`, and
`apply_chat_template(messages)` -> token ids.

- `TiktokenTokenizer`: Kimi's tiktoken BPE (`tiktoken.model`, lines `base64(token) rank`) with Kimi's split
  pattern; special tokens from `tokenizer_config.json` `added_tokens_decoder`.
- `HFTokenizer`: a `tokenizer.json` through the `tokenizers` library.
- `ByteTokenizer`: random-weight configs take and give text: ids 0..2 are specials (pad, bos, eos), byte b
  is id b + 3, so any vocabulary of at least 259 ids works.

The chat template (`chat_template` in `tokenizer_config.json`, or `chat_template.jinja`) is rendered with
jinja2 in a sandbox, then encoded with special tokens recognised where the template wrote them.
`load_tokenizer(model_dir, cfg)` picks the right one.

Kimi K3 ships no Jinja template; its chat format (shared/K3.md) is built in: `K3Tokenizer`, a
`TiktokenTokenizer` chosen by the tokenizer directory's contents: a tiktoken directory with no chat
template whose special tokens include K3's `<|open|>`, `<|close|>`, `<|sep|>` and `<|end_of_msg|>`.
Per message `<|open|>message role="ROLE"<|sep|>` CONTENT `<|close|>message<|sep|><|end_of_msg|>`, then
the generation prefix `<|open|>message role="assistant"<|sep|><|open|>response<|sep|>`. Segments are
encoded one at a time and special tokens are recognised only in the control segments, so a message that
contains the text "<|open|>" stays text. UNSETTLED in K3.md: whether [BOS] is prepended; here it is not,
unless tokenizer_config.json sets `add_bos_token: true` (Kimi K2's and Kimi Linear's templates start
without [BOS]). Generation stops on `<|end_of_msg|>`, the config's eos, which is also this tokenizer's eos.
Earlier assistant turns use the same per-message form as every other role (K3.md gives one form per
turn); whether they should also carry the `<|open|>response<|sep|>` wrapper of the generation prefix is
not established either.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Kimi's pre-tokenisation split: Han runs, words (letters other than Han, optional leading punctuation
# and English contractions), 1-3 digit numbers, punctuation runs, newlines, other whitespace.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
RESERVED_TOKEN = "<|reserved_token_{}|>"

# Kimi K3's special tokens (shared/K3.md) and those its chat format is written with.
K3_SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[PAD]": 163839,
}
K3_CHAT_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K3_ROLE = re.compile(r"^[A-Za-z0-9_.-]+$")  # roles are written into a control segment: no specials, quotes

# A plain-text chat format for tokenizers without a template of their own (the byte-level one).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be read, or a template that fails to render."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def read_chat_template(directory: Path, tok_config: Mapping[str, Any]) -> str | None:
    """`chat_template` of tokenizer_config.json (a string, or a list of {name, template}: the 'default'
    one), else `chat_template.jinja` / `chat_template.json` beside it."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    if (directory / "chat_template.jinja").exists():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / "chat_template.json").exists():
        return _token_text(_read_json(directory / "chat_template.json").get("chat_template"))
    return None


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    from markupsafe import Markup

    return Markup(json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys))


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A jinja2 template in an immutable sandbox, with the helpers HF chat templates use."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template: syntax error: {exc}") from None


class Tokenizer:
    """The interface every tokenizer here has; subclasses set the ids and implement encode/decode."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    # special-token strings the template may refer to (bos_token, eos_token, ...)
    template_tokens: Mapping[str, str] = {}

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def _encode_chat(self, text: str) -> list[int]:
        """Encode rendered chat text, special tokens recognised."""
        return self.encode(text)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The chat template applied to `messages` (each {"role", "content", ...}) as text."""
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise TokenizerError(f"{type(self).__name__} has no chat template")
        cached = self.__dict__.get("_compiled")
        if cached is None or cached[0] != self.chat_template:
            cached = (self.chat_template, compile_template(self.chat_template))
            self.__dict__["_compiled"] = cached
        try:
            return cached[1].render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **dict(self.template_tokens),
                **kw,
            )
        except TemplateError as exc:
            raise TokenizerError(f"chat template: {exc}") from None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered conversation; special tokens appear where the template put them."""
        return self._encode_chat(self.render_chat(messages, add_generation_prompt, **kw))

    @property
    def max_token_id(self) -> int:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    chat_template = DEFAULT_CHAT_TEMPLATE

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 256 + self.offset:
            raise ValueError(
                f"a byte-level tokenizer needs a vocabulary of at least 259 ids, got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special and out-of-byte-range ids are skipped, broken UTF-8 is replaced."""
        data = bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset)
        return data.decode("utf-8", errors="replace")

    def _encode_chat(self, text: str) -> list[int]:
        return self.encode(text, add_bos=True)

    @property
    def max_token_id(self) -> int:
        return 255 + self.offset


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise TokenizerError(f"{path}:{n}: expected 'base64-token rank': {exc}") from None
    if not ranks:
        raise TokenizerError(f"{path}: no tokens")
    return ranks


def _special_ids(config: Mapping[str, Any], path: Path) -> dict[int, str]:
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, Mapping):
        raise TokenizerError(f"{path}: added_tokens_decoder must be an object")
    out = {}
    for key, value in decoder.items():
        text = _token_text(value)
        try:
            out[int(key)] = text
        except ValueError:
            raise TokenizerError(f"{path}: added_tokens_decoder key {key!r} is not a token id") from None
        if text is None:
            raise TokenizerError(f"{path}: added_tokens_decoder[{key}] has no content")
    return out


def _template_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    return {
        k: t
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (t := _token_text(config.get(k)))
    }


class TiktokenTokenizer(Tokenizer):
    """Kimi's tokenizer: byte-level BPE ranks + split pattern + special tokens above the base vocabulary."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        pattern: str = KIMI_PATTERN,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str] | None = None,
        name: str = "kimi",
    ):
        import tiktoken

        # Unnamed ids between the base vocabulary and the last special token are reserved tokens.
        special = dict(special_tokens)
        taken = set(special.values())
        if special:
            for i in range(len(ranks), max(taken)):
                if i not in taken:
                    special[RESERVED_TOKEN.format(i)] = i
        self.encoding = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
        self.special_tokens = special
        self.special_ids = frozenset(special.values())
        self.vocab_size = self.encoding.n_vocab
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens or {})
        self.bos_token_id = special.get(bos_token) if bos_token else None
        self.eos_token_id = special.get(eos_token) if eos_token else None
        self.pad_token_id = special.get(pad_token) if pad_token else None

    @classmethod
    def from_dir(cls, directory: str | Path) -> TiktokenTokenizer:
        directory = Path(directory)
        ranks = read_tiktoken_ranks(directory / "tiktoken.model")
        cfg_path = directory / "tokenizer_config.json"
        config = _read_json(cfg_path) if cfg_path.exists() else {}
        specials = _special_ids(config, cfg_path)
        clash = sorted(i for i in specials if i < len(ranks))
        if clash:
            raise TokenizerError(f"{cfg_path}: special token id {clash[0]} is inside the BPE vocabulary")
        tokens = _template_tokens(config)
        template = read_chat_template(directory, config)
        kw: dict[str, Any] = {}
        klass: type[TiktokenTokenizer] = cls
        if template is None and set(K3_CHAT_TOKENS) <= set(specials.values()):
            klass, kw = K3Tokenizer, {"add_bos": config.get("add_bos_token") is True}
        return klass(
            ranks,
            {text: i for i, text in specials.items()},
            bos_token=tokens.get("bos_token"),
            eos_token=tokens.get("eos_token"),
            pad_token=tokens.get("pad_token"),
            chat_template=template,
            template_tokens=tokens,
            **kw,
        )

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings are plain text unless `allow_special`."""
        ids = self.encoding.encode(
            text, allowed_special="all" if allow_special else set(), disallowed_special=()
        )
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; ids outside the vocabulary are skipped, broken UTF-8 is replaced."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if skip_special:
            keep = [i for i in keep if i not in self.special_ids]
        return self.encoding.decode_bytes(keep).decode("utf-8", errors="replace")

    def _encode_chat(self, text: str) -> list[int]:
        return self.encode(text, allow_special=True)

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1


def k3_chat_segments(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[tuple[str, bool]]:
    """K3's chat format as (text, is_control) segments: per message `<|open|>message role="ROLE"<|sep|>`,
    the content, `<|close|>message<|sep|><|end_of_msg|>`; then the generation prefix. Only control
    segments may hold special tokens. Roles must be plain names (they are written into a control
    segment); contents must be strings."""
    segments: list[tuple[str, bool]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not K3_ROLE.match(role):
            raise TokenizerError(f"messages[{i}].role {role!r}: a K3 role must match {K3_ROLE.pattern}")
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string")
        segments += [
            (f'<|open|>message role="{role}"<|sep|>', True),
            (content, False),
            ("<|close|>message<|sep|><|end_of_msg|>", True),
        ]
    if add_generation_prompt:
        segments.append(('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>', True))
    return segments


class K3Tokenizer(TiktokenTokenizer):
    """Kimi K3: Kimi's tiktoken BPE with K3's built-in chat format (see the module docstring).

    `add_bos`: prepend [BOS] to a rendered conversation (UNSETTLED in K3.md; off by default). The eos is
    `<|end_of_msg|>` (stop on it, not on [EOS]); the pad token is [PAD] when the directory has one."""

    def __init__(
        self, ranks: dict[bytes, int], special_tokens: Mapping[str, int], *, add_bos: bool = False, **kw: Any
    ):
        super().__init__(ranks, special_tokens, **kw)
        missing = [t for t in K3_CHAT_TOKENS if t not in self.special_tokens]
        if missing:
            raise TokenizerError(f"a K3 tokenizer needs the special tokens {missing}")
        self.add_bos = add_bos
        self.eos_token_id = self.special_tokens["<|end_of_msg|>"]
        if self.bos_token_id is None:
            self.bos_token_id = self.special_tokens.get("[BOS]")
        if self.pad_token_id is None:
            self.pad_token_id = self.special_tokens.get("[PAD]")
        names = sorted(K3_CHAT_TOKENS, key=len, reverse=True)
        self._control_split = re.compile("(" + "|".join(re.escape(t) for t in names) + ")")

    def _encode_control(self, text: str) -> list[int]:
        """A control segment: K3's chat special tokens by id, the text between them encoded as text."""
        ids: list[int] = []
        for part in self._control_split.split(text):
            if part in K3_CHAT_TOKENS:
                ids.append(self.special_tokens[part])
            elif part:
                ids += self.encode(part)
        return ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The conversation as text in K3's chat format (template keyword arguments are ignored)."""
        text = "".join(t for t, _ in k3_chat_segments(messages, add_generation_prompt))
        return ("[BOS]" if self.add_bos and self.bos_token_id is not None else "") + text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the conversation, each segment encoded alone (special tokens only in control ones)."""
        ids = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        for text, control in k3_chat_segments(messages, add_generation_prompt):
            ids += self._encode_control(text) if control else self.encode(text)
        return ids


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` through the `tokenizers` library."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens or {})
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id(self.template_tokens.get("bos_token"))
        self.eos_token_id = self._id(self.template_tokens.get("eos_token"))
        self.pad_token_id = self._id(self.template_tokens.get("pad_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        try:
            tok = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise TokenizerError(f"{directory / 'tokenizer.json'}: cannot load: {exc}") from None
        cfg_path = directory / "tokenizer_config.json"
        config = _read_json(cfg_path) if cfg_path.exists() else {}
        return cls(
            tok, chat_template=read_chat_template(directory, config), template_tokens=_template_tokens(config)
        )

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of `text` (no post-processor); special-token strings are text unless `allow_special`."""
        self.tokenizer.encode_special_tokens = not allow_special
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(keep, skip_special_tokens=skip_special)

    def _encode_chat(self, text: str) -> list[int]:
        return self.encode(text, allow_special=True)

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1


def load_tokenizer(model_dir: str | Path | None, cfg: Any) -> Tokenizer | None:
    """The tokenizer of a model directory (`tiktoken.model`, else `tokenizer.json`), else the byte-level one
    for random-weight configs (None when the vocabulary is too small even for that). The tokenizer's ids
    must fit the model's vocabulary."""
    tok: Tokenizer | None = None
    if model_dir is not None:
        directory = Path(model_dir)
        if (directory / "tiktoken.model").exists():
            tok = TiktokenTokenizer.from_dir(directory)
        elif (directory / "tokenizer.json").exists():
            tok = HFTokenizer.from_dir(directory)
    if tok is None:
        return ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 256 + ByteTokenizer.offset else None
    if tok.max_token_id >= cfg.vocab_size:
        raise TokenizerError(
            f"{model_dir}: the tokenizer has ids up to {tok.max_token_id}, "
            f"beyond the model's vocab_size {cfg.vocab_size}"
        )
    if tok.eos_token_id is None and cfg.eos_token_id is not None:
        tok.eos_token_id = cfg.eos_token_id
    if tok.bos_token_id is None and cfg.bos_token_id is not None:
        tok.bos_token_id = cfg.bos_token_id
    return tok
