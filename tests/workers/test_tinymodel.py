"""Tiny model builder.

Aspects under test:
- the same seed gives identical weights, another seed different ones
- a rebuild with the same parameters is a no-op; changed parameters rebuild
- the saved tokenizer (loaded the way vLLM loads it) is one token per character and round-trips
- bos / eos / pad ids agree between tokenizer, config and generation config
- invalid sizes are rejected with the field name; the CLI prints the path
- every file is readable by any uid (the pods run as uid 1000; safetensors writes 0600), also
  for a model an older builder left 0600; a worker that may not read a model file says
  "permission denied" with mode, owner and the fix, not "no such file"
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rljob_workers.main import unreadable_model_files
from rljob_workers.tinymodel import ALPHABET, MANIFEST_NAME, build_tiny_model, main


def _weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def test_build_tiny_model_same_seed_identical_weights(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    first, second = _weights(tiny_model_dir), _weights(again)
    assert first.keys() == second.keys()
    assert all(first[name].equal(second[name]) for name in first)


def test_build_tiny_model_other_seed_different_weights(tiny_model_dir, tmp_path):
    other = _weights(build_tiny_model(tmp_path / "other", seed=1))
    base = _weights(tiny_model_dir)
    assert not base["model.embed_tokens.weight"].equal(other["model.embed_tokens.weight"])


def test_build_tiny_model_same_parameters_is_noop(tiny_model_dir):
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_build_tiny_model_changed_parameters_rebuilds(tmp_path):
    out = build_tiny_model(tmp_path / "m", num_layers=1)
    build_tiny_model(out, num_layers=2)
    weights = _weights(out)
    assert any(name.startswith("model.layers.1.") for name in weights)
    assert '"num_layers": 2' in (out / MANIFEST_NAME).read_text()


def test_tokenizer_alphabet_one_token_per_char_roundtrip(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer(ALPHABET)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(ALPHABET) + 1
    assert len(set(ids[1:])) == len(ALPHABET)
    assert tokenizer.decode(ids, skip_special_tokens=True) == ALPHABET
    assert tokenizer.decode(tokenizer("3 + 4 = 7, ok?")["input_ids"][1:]) == "3 + 4 = 7, ok?"


def test_tokenizer_special_ids_match_model_config(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    generation = GenerationConfig.from_pretrained(str(tiny_model_dir))
    assert config.vocab_size == len(tokenizer)
    assert generation.eos_token_id == config.eos_token_id == tokenizer.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.decode([tokenizer.eos_token_id]) == "</s>"


def test_build_tiny_model_hidden_size_not_multiple_of_head_raises(tmp_path):
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tmp_path / "bad", hidden_size=48)


def test_main_existing_model_prints_path(tiny_model_dir, capsys):
    assert main([str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_model_dir)


def test_build_tiny_model_files_readable_by_any_uid_also_when_reused(tmp_path):
    out = build_tiny_model(tmp_path / "m")
    (out / "model.safetensors").chmod(0o600)  # as an older builder left it
    build_tiny_model(out)
    for path in [out, *out.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    assert unreadable_model_files(out, uid=1000, gids=[1000]) == []


def test_unreadable_model_file_says_permission_denied_with_mode_owner_and_fix(tmp_path):
    out = build_tiny_model(tmp_path / "m")
    (out / "model.safetensors").chmod(0o600)
    owner = (out / "model.safetensors").stat().st_uid
    assert unreadable_model_files(out, uid=1000, gids=[1000]) == [
        f"spec.model.path: {out / 'model.safetensors'}: permission denied (mode 0600, owner uid "
        f"{owner}; this worker runs as uid 1000); make the model readable, e.g. chmod -R a+rX {out}"
    ]
