"""llama.cpp on the same weights, for `jaxhybrid bench reference --against llama.cpp`.

llama.cpp is what CPU users run for Kimi Linear. This module converts a Hugging Face directory with
llama.cpp's own `convert_hf_to_gguf.py` (f32) and `llama-quantize` (q8_0), times `llama-bench` on both, and
runs `llama-completion` greedily so its tokens can be checked against ours. It is an optional benchmark
dependency: nothing here runs in the tests.

Where llama.cpp comes from: `--llama-cpp DIR`, a llama.cpp source tree with the tools built under
`build/bin` (or `$LLAMA_CPP`); or `--build-llama-cpp DIR`, which downloads the `llama-cpp-python` sdist from
PyPI and builds the copy of llama.cpp vendored in it (cmake, about 15 minutes on 2 cores). The build turns
off `GGML_NATIVE` and names the AVX-512 extensions instead: a native build on a CPU that reports AMX used
AMX tiles in its q8_0 products, which died with "Illegal instruction" in a VM that does not enable them.

What the conversion adds to the directory (a copy of links, the checkpoint untouched):
- a `tokenizer.json` with the ids of `jaxhybrid.tokenizer.ByteTokenizer` (0..2 specials, byte b -> b + 3,
  every other id a token "<|unused_N|>"), so llama.cpp tokenizes a text prompt as we do and its output text
  maps back to ids; llama.cpp needs one merge, given to the bytes 0x00 0x01, which no text prompt holds;
- two config fields transformers does not write: `num_key_value_heads` = the heads (MLA), and the router's
  `moe_router_activation_func` (sigmoid);
- in the converter's process only: the pre-tokenizer is named "gpt-2" (the converter recognises
  pre-tokenizers by a hash of known tokenizers' output), and the dense first layer's
  `block_sparse_moe.{gate,up,down}_proj`, as transformers names it, is read as the `mlp.*` the converter
  maps.
q8_0 keeps the MLA layers' `attn_k_b` / `attn_v_b` in f32: with them in q8_0, llama.cpp's scheduler finds
no backend for an op (GGML_ASSERT(*cur_backend_id != -1)).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.quant import agreed_prefix
from jaxhybrid.tokenizer import ByteTokenizer

TOOLS = ("llama-bench", "llama-completion", "llama-quantize")
BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{x}=ON" for x in ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_VBMI")),
    "-DGGML_AVX512_BF16=ON",
    "-DGGML_AVX_VNNI=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
KEEP_F32 = ("attn_k_b", "attn_v_b")
UNUSED = re.compile(rb"<\|unused_(\d+)\|>")


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, did not build, or one of its tools failed (the message says which)."""


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp source tree (`convert_hf_to_gguf.py`, `gguf-py`) and the directory of its built tools."""

    src: Path
    bin: Path

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def locate(path: str | None) -> LlamaCpp:
    """The llama.cpp at `path` (or $LLAMA_CPP): its source tree, tools in `build/bin` or `bin`."""
    path = path or os.environ.get("LLAMA_CPP")
    if not path:
        raise LlamaCppError(
            "--against llama.cpp needs --llama-cpp DIR (a built llama.cpp) or --build-llama-cpp DIR"
        )
    src = Path(path)
    for bin_dir in (src / "build" / "bin", src / "bin", src):
        if all((bin_dir / t).is_file() for t in TOOLS):
            break
    else:
        raise LlamaCppError(
            f"{src} has no built {', '.join(TOOLS)} (in build/bin); build it or use --build-llama-cpp"
        )
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppError(f"{src} is not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    return LlamaCpp(src, bin_dir)


def _run(cmd: list[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, **kwargs)
    if out.returncode != 0:
        tail = (
            out.stderr[-2000:].decode(errors="replace")
            if isinstance(out.stderr, bytes)
            else out.stderr[-2000:]
        )
        raise LlamaCppError(f"{what} failed (exit {out.returncode}): {' '.join(cmd[:3])} ...\n{tail}")
    return out


def build(dest: str) -> LlamaCpp:
    """Download the llama-cpp-python sdist into `dest`, build its vendored llama.cpp's tools; reuse a build
    already there."""
    root = Path(dest)
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found and all((found[-1] / "build" / "bin" / t).is_file() for t in TOOLS):
        return locate(str(found[-1]))
    root.mkdir(parents=True, exist_ok=True)
    if not found:
        print(f"llama.cpp: downloading the llama-cpp-python sdist into {root}", file=sys.stderr)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "llama-cpp-python",
                "-d",
                str(root),
            ],
            "pip download",
        )
        sdist = sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
        found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    src = found[-1]
    print(f"llama.cpp: building {', '.join(TOOLS)} in {src}/build (cmake; minutes)", file=sys.stderr)
    _run(["cmake", "-S", str(src), "-B", str(src / "build"), *BUILD_FLAGS], "cmake configure")
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(src / "build"), "-j", jobs, "--target", *TOOLS], "cmake build")
    return locate(str(src))


def byte_tokenizer_json(vocab_size: int) -> str:
    """A `tokenizers` byte-level BPE whose ids are ByteTokenizer's (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    char = _gpt2_byte_chars()
    byte = ByteTokenizer(vocab_size)
    vocab = {"<pad>": byte.pad_token_id, "<s>": byte.bos_token_id, "</s>": byte.eos_token_id}
    vocab |= {char[b]: b + byte.offset for b in range(256)}
    merged = 256 + byte.offset
    vocab[char[0] + char[1]] = merged
    vocab |= {f"<|unused_{i}|>": i for i in range(merged + 1, vocab_size)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(char[0], char[1])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    return tok.to_str()


def _gpt2_byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (printable Latin-1 itself, the rest from U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def export(model_dir: str, out: Path) -> Path:
    """`out`: links to `model_dir`'s files, a config with the two fields llama.cpp reads, the tokenizer."""
    src = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.name not in ("config.json", "tokenizer.json", "tokenizer_config.json")
            and not (out / f.name).exists()
        ):
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.setdefault("moe_router_activation_func", "sigmoid")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "tokenizer.json").write_text(byte_tokenizer_json(int(cfg["vocab_size"])))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(
        json.dumps(special | {"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return out


# Runs llama.cpp's converter in its own process with the two adjustments the module docstring names.
_CONVERT = """
import re, runpy, sys
src, model, outfile = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import conversion.kimi_linear as kl
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
modify = kl.KimiLinearModel.modify_tensors
def renamed(self, data, name, bid):
    name = re.sub(r"block_sparse_moe\\.(gate_proj|up_proj|down_proj)", r"mlp.\\1", name)
    return modify(self, data, name, bid)
kl.KimiLinearModel.modify_tensors = renamed
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", outfile]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(llama: LlamaCpp, model_dir: str, work: Path) -> dict[str, Path]:
    """{"f32": gguf, "q8_0": gguf} of `model_dir`, written under `work` (reused when already there)."""
    exported = export(model_dir, work / "hf")
    f32, q8 = work / "model-f32.gguf", work / "model-q8_0.gguf"
    if not f32.exists():
        print(f"llama.cpp: converting {model_dir} to {f32}", file=sys.stderr)
        _run(
            [sys.executable, "-c", _CONVERT, str(llama.src), str(exported), str(f32) + ".tmp"],
            "convert_hf_to_gguf",
        )
        os.replace(str(f32) + ".tmp", f32)
    if not q8.exists():
        keep = [a for name in KEEP_F32 for a in ("--tensor-type", f"{name}=f32")]
        _run([llama.tool("llama-quantize"), *keep, str(f32), str(q8) + ".tmp", "q8_0", "2"], "llama-quantize")
        os.replace(str(q8) + ".tmp", q8)
    return {"f32": f32, "q8_0": q8}


def bench(
    llama: LlamaCpp, gguf: Path, threads: int, *, prompt: int = 0, gen: int = 0, depth: int = 0
) -> float:
    """tokens/s of one `llama-bench` test (one repetition): a `prompt`-token prefill, or `gen` decode
    steps after a `depth`-token context."""
    cmd = [llama.tool("llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    cmd += ["-p", str(prompt), "-n", str(gen), "-d", str(depth), "--no-warmup"]
    out = _run(cmd, "llama-bench", text=True)
    rows = json.loads(out.stdout)
    if len(rows) != 1:
        raise LlamaCppError(f"llama-bench gave {len(rows)} results for one test")
    return float(rows[0]["avg_ts"])


def greedy(llama: LlamaCpp, gguf: Path, prompt: str, steps: int, threads: int) -> list[int]:
    """The ids llama.cpp generates greedily after the text `prompt` (parsed back from its output text)."""
    cmd = [llama.tool("llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(steps), "--temp", "0"]
    cmd += ["--ignore-eos", "-no-cnv", "-t", str(threads), "-c", str(len(prompt.encode()) + steps + 16)]
    out = _run(cmd + ["--no-warmup", "--no-display-prompt"], "llama-completion", stdin=subprocess.DEVNULL)
    return output_ids(out.stdout)[:steps]  # the tool ends its output with newlines of its own


def output_ids(text: bytes) -> list[int]:
    """ByteTokenizer ids of llama-completion's output: "<|unused_N|>" is id N, any other byte b is b + 3."""
    ids, pos, offset = [], 0, ByteTokenizer.offset
    for m in UNUSED.finditer(text):
        ids += [b + offset for b in text[pos : m.start()]]
        ids.append(int(m.group(1)))
        pos = m.end()
    return ids + [b + offset for b in text[pos:]]


def describe(llama: LlamaCpp) -> dict[str, Any]:
    """Which llama.cpp ran: its path and the first line of `llama-completion --version`."""
    out = subprocess.run([llama.tool("llama-completion"), "--version"], capture_output=True, text=True)
    version = (out.stdout + out.stderr).strip().splitlines()
    return {"path": str(llama.src), "version": version[0] if version else None}


WEIGHT_TYPES = ("f32", "q8_0")


class LlamaRuns:
    """llama.cpp's side of `bench reference`: the converted models, one round of timings, the greedy check."""

    def __init__(self, llama: LlamaCpp, model_dir: str, work: Path, threads: int):
        self.llama, self.threads = llama, threads
        self.models = convert(llama, model_dir, work)

    def round(
        self, lengths: list[int], decode_prompt: int, decode_tokens: int
    ) -> dict[str, tuple[int, float]]:
        """{name: (tokens, tokens/s)} of one repetition of every test: prefill per length, then decode."""
        out = {}
        for wtype, gguf in self.models.items():
            for n in lengths:
                out[f"llama_{wtype}_prefill_{n}"] = (n, bench(self.llama, gguf, self.threads, prompt=n))
            rate = bench(self.llama, gguf, self.threads, gen=decode_tokens, depth=decode_prompt)
            out[f"llama_{wtype}_decode"] = (decode_tokens, rate)
        return out

    def agreement(self, prompt: str, steps: int, ours: list[int]) -> dict[str, Any]:
        """How many of `ours` (our greedy ids after `prompt`) each llama.cpp model generates the same."""
        out: dict[str, Any] = {"greedy_prompt": prompt, "greedy_jaxhybrid": ours}
        for wtype, gguf in self.models.items():
            theirs = greedy(self.llama, gguf, prompt, steps, self.threads)
            out[f"greedy_llama_{wtype}"] = theirs
            out[f"greedy_same_prefix_llama_{wtype}"] = f"{agreed_prefix(ours, theirs)}/{steps}"
        return out
