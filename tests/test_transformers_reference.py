"""Against transformers' own KimiLinearForCausalLM (the optional extra `reference`; `.ci/run` installs it, a
checkout without it skips this file): a checkpoint that transformers initialises and saves loads here and
gives its logits (fp32, 1e-5 relative), for tiny and tiny-grouped (q_lora, group-limited routing, two shared
experts) over 72 tokens, through the jitted full pass `bench reference` times. Its Kimi Linear has none of
Kimi K3's additions; `make_small` refuses a config that sets one."""

import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.reference import OurModel, TorchModel, make_small  # noqa: E402
from jaxhybrid.config import load_config  # noqa: E402
from jaxhybrid.weights.hf import write_config  # noqa: E402


@pytest.mark.parametrize("name", ["tiny", "tiny-grouped"])
def test_a_transformers_checkpoint_gives_transformers_logits(tmp_path, name):
    # transformers' Kimi Linear has no bounded forget gate (a K3 addition): tiny-grouped without it
    cfg = load_config(name).replace(gate_lower_bound=None)
    (tmp_path / "cfg").mkdir()
    write_config(cfg, tmp_path / "cfg")
    make_small(str(tmp_path / "model"), str(tmp_path / "cfg" / "config.json"), seed=3)
    tokens = np.random.default_rng(0).integers(3, 300, 72).astype(np.int32)
    want, _ = TorchModel(str(tmp_path / "model")).logits(tokens)
    got, _ = OurModel(str(tmp_path / "model"), max_len=len(tokens)).logits(tokens)
    # torch's float32 and ours: two float32 evaluations of one model (`bounds.float32_network_bound`)
    assert rel_err(got, want) < float32_network_bound(cfg, len(tokens))


def test_make_small_refuses_what_transformers_would_ignore(tmp_path):
    with pytest.raises(ValueError, match="gate_lower_bound"):
        make_small(str(tmp_path), "tiny-grouped", seed=0)
