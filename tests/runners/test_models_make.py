"""`omni-core models make`: complete, loadable, deterministic checkpoints; errors that say what is valid."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from omni_core.cli import main as cli_main
from omni_core.models import FAMILIES, ModelSpecError, make_checkpoint
from omni_core.models.make import param_count


def tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def tensor_digests(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                out[f"{path.relative_to(directory)}:{name}"] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    return out


@pytest.mark.parametrize("family", ["qwen2", "dit"])
def test_same_seed_same_bytes_other_seed_other_weights(family, checkpoints, tmp_path):
    again = Path(make_checkpoint(family, "tiny", tmp_path / "again", seed=0).path)
    assert tree_digest(again) == tree_digest(checkpoints[family])
    ours, other = tensor_digests(checkpoints[family]), tensor_digests(checkpoints[f"{family}-seed1"])
    assert ours.keys() == other.keys()
    assert all(ours[name] != other[name] for name in ours), "every tensor must depend on the seed"


def test_llm_checkpoint_loads_with_its_tokenizer(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for family, tied in (("qwen2", True), ("llama", False)):
        directory = checkpoints[family]
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
        assert model.config.model_type == family
        assert len(tokenizer) == model.config.vocab_size  # every id the model emits decodes
        ids = tokenizer("Level two discards everything.")["input_ids"]
        assert tokenizer.decode(ids) == "Level two discards everything."
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied


def test_diffusion_checkpoints_load_as_their_pipelines(checkpoints):
    from diffusers import DDPMPipeline, DiffusionPipeline, DiTPipeline, StableDiffusionPipeline

    dit = DiffusionPipeline.from_pretrained(str(checkpoints["dit"]), local_files_only=True)
    assert isinstance(dit, DiTPipeline) and dit.get_label_ids(["class 7"]) == [7]
    assert type(dit.scheduler).__name__ == "DDIMScheduler"
    ddpm = DiffusionPipeline.from_pretrained(str(checkpoints["ddpm"]), local_files_only=True)
    assert isinstance(ddpm, DDPMPipeline) and type(ddpm.scheduler).__name__ == "DDPMScheduler"
    index = json.loads((checkpoints["dit"] / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    sd = DiffusionPipeline.from_pretrained(str(checkpoints["sd"]), local_files_only=True)
    assert isinstance(sd, StableDiffusionPipeline) and sd.safety_checker is None
    ids = sd.tokenizer("A cat, on a mat!").input_ids
    assert ids[0] == sd.tokenizer.bos_token_id and ids[-1] == sd.tokenizer.eos_token_id
    assert sd.tokenizer.decode(ids, skip_special_tokens=True) == "a cat , on a mat !"  # CLIP lower-cases
    assert len(sd.tokenizer) == sd.text_encoder.config.vocab_size


def test_catalog_param_counts_are_the_models():
    # On the meta device: the 1.5B models cost no memory here.
    for family in FAMILIES.values():
        for size in family.sizes.values():
            assert param_count(family.name, size.name) == size.nominal_params, (family.name, size.name)
    assert 1.4e9 < FAMILIES["qwen2"].sizes["1.5b"].nominal_params < 1.6e9
    assert 1.4e9 < FAMILIES["llama"].sizes["1.5b"].nominal_params < 1.6e9
    assert 5.5e8 < FAMILIES["dit"].sizes["600m"].nominal_params < 6.5e8


def test_cli_errors_name_what_is_valid(tmp_path, capsys):
    assert cli_main(["models", "make", "gpt9", "tiny", str(tmp_path / "a")]) == 2
    families = "['ddpm', 'dit', 'llama', 'qwen2', 'sd']"
    assert f"unknown model family 'gpt9'; choose one of {families}" in capsys.readouterr().err
    assert cli_main(["models", "make", "dit", "7b", str(tmp_path / "a")]) == 2
    assert "family 'dit' has no size '7b'; its sizes are ['tiny', '600m']" in capsys.readouterr().err
    assert cli_main(["models", "make", "qwen2", "tiny", str(tmp_path / "a"), "--dtype", "int8"]) == 2
    assert "dtype 'int8' is not supported" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_cli_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert cli_main(["models", "make", "ddpm", "tiny", str(target)]) == 2
    assert "is not empty" in capsys.readouterr().err and sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert cli_main(["models", "make", "ddpm", "tiny", str(target), "--force", "--seed", "3"]) == 0
    assert "ddpm tiny: 0.18M params, float32, seed 3" in capsys.readouterr().out
    assert (target / "notes.txt").read_text() == "mine"  # --force replaces only what it writes
    assert (target / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    with pytest.raises(ModelSpecError, match="is not empty"):
        make_checkpoint("ddpm", "tiny", target)
