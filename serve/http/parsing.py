"""Request bodies to validated requests: JSON decoding with limits, the OpenAI fields, 400s naming
the field."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from jaxhybrid.tokenizer import TokenizerError
from serve.engine.engine import EngineAPI
from serve.engine.requests import RequestError, check_cache_salt
from serve.engine.sampling import SamplingError, SamplingParams
from serve.engine.speculative import DraftMethod, Speculation, SpeculationError
from serve.http.errors import APIError, show

# Fields the OpenAI API defines that do not change what this server computes: accepted (type-checked) and
# ignored, so unchanged clients work.
IGNORED_OPENAI_FIELDS = {
    "user": str,
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "logit_bias": dict,
    "service_tier": str,
    "store": bool,
    "metadata": dict,
    "parallel_tool_calls": bool,
}
MAX_BODY_BYTES = 16 * 2**20
OFFLOAD_BYTES = 64 * 2**10  # bodies larger than this are decoded and tokenised off the event loop

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "logprobs",
    "ignore_eos",
    "cache_salt",
    "stream",
    "stream_options",
    "return_token_ids",
    "speculative",
    # what routers add to every request they forward (sglang-router: at these values), which change
    # nothing here; any other value is refused (`neutral` in `_check_fields`)
    "no_stop_trim",
    "skip_special_tokens",
    "return_hidden_states",
} | set(IGNORED_OPENAI_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


@dataclasses.dataclass
class Prepared:
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    cache_salt: str | None
    return_token_ids: bool = False


log = logging.getLogger("jaxhybrid.server")


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


MAX_JSON_DEPTH = 32  # a request body nests a few levels (messages -> content parts); deeper is refused
MAX_STOP_CHARS = 1024


def decode_body(raw: bytes) -> Any:
    """The JSON document of a request body, or a 400 APIError: not UTF-8, not JSON, nested deeper than
    MAX_JSON_DEPTH, or holding text UTF-8 cannot encode (lone surrogates), in a value or a field name."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from (
            None
        )
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and integers of > 4300 digits
        raise bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    stack: list[tuple[Any, int, str | None]] = [(body, 0, None)]
    while stack:  # iterative: the document may be nested up to the parser's recursion limit
        node, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", field, "invalid_json")
        if isinstance(node, str):
            _check_text(node, field)
        elif isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, field if depth else None)
                stack.append((value, depth + 1, key if depth == 0 else field))
        elif isinstance(node, list):
            stack.extend((value, depth + 1, field) for value in node)
    return body


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = f"'{field}'" if field is not None else "a field name"
        raise bad(f"{where} holds text that is not valid Unicode (a lone surrogate)", field) from None


def _get_int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {show(v)}", name, "invalid_type")
    return v


def _get_float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"'{name}' must be a number, got {show(v)}", name, "invalid_type")
    try:
        return float(v)
    except OverflowError:  # an integer of more than about 309 digits
        raise bad(f"'{name}' is too large: {show(v)}", name) from None


def _get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {show(v)}", name, "invalid_type")
    return v


class RequestParser:
    """Turns a JSON body into a `Prepared` request or an APIError naming the field."""

    def __init__(self, engine: EngineAPI, tokenizer: Any, model_name: str, default_max_tokens: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab = engine.model_config.vocab_size
        self.context = engine.max_model_len
        self.speculative_tokens = engine.config.speculative.num_tokens  # a request's default and its limit
        self.has_draft_model = engine.has_draft_model
        self.default_max_tokens = default_max_tokens
        self.eos = engine.model_config.eos_token_id

    def _check_fields(self, body: dict, allowed: set[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad(f"unknown field '{unknown[0]}'", unknown[0], "unknown_field")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                400,
                f"the model '{model}' does not exist here; this server serves '{self.model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        for name, kind in IGNORED_OPENAI_FIELDS.items():
            v = body.get(name)
            if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
                raise bad(f"'{name}' has the wrong type", name, "invalid_type")
        neutral = {
            "n": (1,),
            "best_of": (1,),
            "echo": (False,),
            "suffix": ("",),
            "top_logprobs": (0,),
            "no_stop_trim": (False,),
            "skip_special_tokens": (True,),
            "return_hidden_states": (False,),
        }
        for name, ok in neutral.items():
            v = body.get(name)
            if v is not None and not any(v == o and type(v) is type(o) for o in ok):
                raise bad(f"'{name}' = {show(v)} is not supported (allowed: {ok[0]!r})", name)

    def _speculative(self, body: dict[str, Any]) -> Speculation | None:
        """The request's `speculative` field: "ngram" / "off", or {"method": ..., "num_speculative_tokens":
        k}; None when absent (the server's default)."""
        value = body.get("speculative")
        if value is None:
            return None
        k: object = self.speculative_tokens
        if isinstance(value, dict):
            unknown = set(value) - {"method", "num_speculative_tokens"}
            if unknown or "method" not in value:
                raise bad(
                    "'speculative' must be a method name or an object with 'method' and optionally "
                    "'num_speculative_tokens'",
                    "speculative",
                    "invalid_type",
                )
            method, k = value["method"], value.get("num_speculative_tokens", k)
        elif isinstance(value, str):
            method = value
        else:
            raise bad("'speculative' must be a string or an object", "speculative", "invalid_type")
        try:
            spec = Speculation.parse(method, k)
            spec.validate(self.speculative_tokens)
        except SpeculationError as exc:
            raise bad(f"'speculative': {exc}", "speculative") from None
        if spec.method is DraftMethod.DRAFT and not self.has_draft_model:
            raise bad(
                "'speculative': this server has no draft model (serve --speculative draft:DIR)", "speculative"
            )
        return spec

    def _stop(self, body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
        stop = body.get("stop")
        items = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
        if isinstance(stop, bool) or not isinstance(items, list):
            raise bad("'stop' must be a string, a token id or a list of them", "stop", "invalid_type")
        strings, ids = [], []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise bad("'stop' strings must not be empty", "stop")
                if len(item) > MAX_STOP_CHARS:
                    raise bad(f"'stop' strings may be at most {MAX_STOP_CHARS} characters", "stop")
                strings.append(item)
            elif _is_int(item):
                ids.append(item)
            else:
                raise bad(f"'stop' entries must be strings or token ids, got {show(item)}", "stop")
        extra = body.get("stop_token_ids")
        if extra is not None:
            if not isinstance(extra, list) or not all(_is_int(t) for t in extra):
                raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
            ids += extra
        if len(strings) + len(ids) > 16:
            raise bad("at most 16 stop sequences", "stop")
        if strings and self.tokenizer is None:
            raise bad("stop strings need a tokenizer, which this model lacks: use token ids", "stop")
        return tuple(strings), tuple(dict.fromkeys(ids))

    def _prompt_ids(self, body: dict) -> list[int]:
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt", "missing_field")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) != 1:
                raise bad("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad("this model has no tokenizer: send the prompt as token ids", "prompt")
            try:
                ids = self.tokenizer.encode(prompt)
            except Exception as exc:  # noqa: BLE001 - text the tokenizer cannot take is the client's problem
                raise bad(f"the prompt could not be tokenized: {exc}", "prompt") from None
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
        if not ids:
            raise bad("the prompt is empty", "prompt")
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:
            raise bad(f"token id {outside[0]} is outside the vocabulary [0, {self.vocab})", "prompt")
        return ids

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise bad(f"{where} must be an object", where, "invalid_type")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role:
                raise bad(f"{where}.role must be a non-empty string", f"{where}.role")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"):
                        raise bad(f"{where}.content: only text parts are supported", f"{where}.content")
                    if not isinstance(part.get("text"), str):
                        raise bad(f"{where}.content: a text part needs 'text'", f"{where}.content")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
            clean.append({**m, "role": role, "content": content})
        if self.tokenizer is None:
            raise bad("this model has no tokenizer, so no chat template: use /v1/completions", "messages")

        try:
            ids = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
        except TokenizerError as exc:
            raise bad(str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template could not render these messages
            log.warning("the chat template failed on a request: %s: %s", type(exc).__name__, exc)
            raise bad(f"the conversation could not be rendered: {exc}", "messages") from None
        if not ids:
            raise bad("the rendered conversation is empty", "messages")
        return list(ids)

    def parse(self, body: Any, kind: str) -> Prepared:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None, "invalid_json")
        self._check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
        prompt = self._prompt_ids(body) if kind == "completion" else self._chat_ids(body)
        room = self.context - len(prompt)
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {len(prompt)} tokens; this model's context is {self.context} tokens, "
                "which leaves no room to generate",
                "invalid_request_error",
                "messages" if kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        name = "max_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"
        max_tokens = _get_int(body, name, None)
        if max_tokens is None:
            max_tokens = min(16 if kind == "completion" else self.default_max_tokens, room)
        elif max_tokens < 1:
            raise bad(f"'{name}' must be at least 1, got {max_tokens}", name)
        elif max_tokens > room:
            raise APIError(
                400,
                f"the prompt ({len(prompt)} tokens) + {name} ({max_tokens}) = {len(prompt) + max_tokens} "
                f"exceeds this model's context of {self.context} tokens",
                "invalid_request_error",
                name,
                "context_length_exceeded",
            )
        stop, stop_ids = self._stop(body)
        top_k = _get_int(body, "top_k", 0)
        logprobs_v = body.get("logprobs")
        if kind == "completion":
            if logprobs_v is not None and (isinstance(logprobs_v, bool) or not _is_int(logprobs_v)):
                raise bad("'logprobs' must be an integer (0 or 1) or null", "logprobs", "invalid_type")
            if logprobs_v is not None and not 0 <= logprobs_v <= 1:
                raise bad(
                    "'logprobs' must be 0 or 1: only the sampled token's log-probability is reported",
                    "logprobs",
                )
            logprobs = logprobs_v is not None
        else:
            logprobs = _get_bool(body, "logprobs", False)
        stream = _get_bool(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise bad("'stream_options' needs 'stream': true", "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise bad("'stream_options' may only hold 'include_usage'", "stream_options")
            include_usage = _get_bool(options, "include_usage", False)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise bad("'cache_salt' must be a non-empty string", "cache_salt", "invalid_type")
        try:
            check_cache_salt(salt)
        except RequestError as exc:
            raise bad(str(exc), "cache_salt") from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_get_float(body, "temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,
            top_p=_get_float(body, "top_p", 1.0),
            seed=_get_int(body, "seed", None),
            stop_token_ids=stop_ids,
            ignore_eos=_get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            speculative=self._speculative(body),
        )
        try:
            params.validate(self.vocab)
        except SamplingError as exc:
            field = str(exc).split(" ", 1)[0]
            param = "stop" if field == "stop_token_ids" else field
            raise bad(str(exc), param) from None
        return_ids = _get_bool(body, "return_token_ids", False)
        return Prepared(kind, prompt, params, stop, stream, include_usage, logprobs, salt, return_ids)
