"""Build a tiny, randomly initialised Qwen2 causal LM with a character-level tokenizer.

The model is the test and demo stand-in for a real checkpoint: nothing is downloaded, the
weights come from a seeded random init, and the tokenizer maps every character of a fixed
alphabet (digits, lowercase letters, space and ``+-*=:?,.``) to one token. Encoding prepends
``<s>``; generation stops at ``</s>``.

``chat=True`` builds the chat variant: a wider alphabet (upper case, newline and the signs word
problems use), ChatML's ``<|im_start|>`` and ``<|im_end|>`` as special tokens (``<|im_end|>`` ends
generation), ``<answer>`` and ``</answer>`` as single ordinary tokens, and a real chat template
(ChatML, as Qwen2.5's) in its tokenizer config.

Run ``python -m rljob_workers.tinymodel OUT_DIR [--chat]`` to build one from the command line.
"""

from __future__ import annotations

import argparse
import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
ALPHABET: str = string.digits + string.ascii_lowercase + " " + "+-*=:?,."
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(ALPHABET)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ANSWER_TAGS = ("<answer>", "</answer>")
CHAT_ALPHABET: str = ALPHABET + string.ascii_uppercase + "\n#$%()/'!;"
CHAT_VOCAB: tuple[str, ...] = (*SPECIAL_TOKENS, IM_START, IM_END, *ANSWER_TAGS, *CHAT_ALPHABET)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, the template of Qwen2.5's instruct models."""
MANIFEST_NAME = "rljob-tinymodel.json"
ATTENTION_HEAD_DIM = 32  # smallest head size vLLM's CPU attention backend accepts


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny model's bytes; stored beside it as a manifest."""

    seed: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_kv_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    vocab: tuple[str, ...] = VOCAB
    chat: bool = False


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int | None = None,
    num_kv_heads: int = 1,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    chat: bool = False,
) -> Path:
    """Build (or reuse) a tiny Qwen2ForCausalLM checkpoint in ``out_dir`` and return its path.

    The weights are float32, randomly initialised from ``seed`` (the global torch RNG is left
    untouched), and saved as safetensors with config, generation config and tokenizer. The call is
    idempotent: when ``out_dir`` already holds a model built with the same parameters it returns
    at once. ``hidden_size`` must be a multiple of 32 (the attention head size).
    """
    if hidden_size % ATTENTION_HEAD_DIM:
        raise ValueError(f"hidden_size: {hidden_size} is not a multiple of {ATTENTION_HEAD_DIM}")
    num_heads = hidden_size // ATTENTION_HEAD_DIM
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: {num_kv_heads} does not divide {num_heads} heads")
    spec = TinyModelSpec(
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        vocab=CHAT_VOCAB if chat else VOCAB,
        chat=chat,
    )
    out = Path(out_dir)
    if _read_manifest(out) != spec:
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        build_tokenizer(chat=chat).save_pretrained(str(out))
        _save_model(out, spec)
        (out / MANIFEST_NAME).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    _make_readable(out)
    return out


def _make_readable(out: Path) -> None:
    """Files 0644, folders 0755: the pods run as a non-root uid (1000), and safetensors writes
    its file 0600. A demo model holds nothing secret."""
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _read_manifest(out: Path) -> TinyModelSpec | None:
    try:
        raw = json.loads((out / MANIFEST_NAME).read_text())
        raw["vocab"] = tuple(raw["vocab"])
        return TinyModelSpec(**raw)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def build_tokenizer(*, chat: bool = False) -> PreTrainedTokenizerBase:
    """Return the character-level tokenizer over ``VOCAB`` (``CHAT_VOCAB`` and the chat template
    with ``chat``).

    It is a byte-level BPE with no merges, so every character is one token. That is exactly the
    pipeline ``Qwen2Tokenizer`` rebuilds from ``tokenizer.json`` (``AutoTokenizer`` forces it for a
    ``qwen2`` config, in transformers and in vLLM alike); a WordLevel model would silently lose the
    space there. Characters outside ``ALPHABET`` are dropped by the encoder.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {_byte_level(token): index for index, token in enumerate(CHAT_VOCAB if chat else VOCAB)}
    tokenizer: PreTrainedTokenizerBase = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        bos_token=BOS_TOKEN,
        eos_token=IM_END if chat else EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        add_bos_token=not chat,  # a chat template says where the prompt starts
        clean_up_tokenization_spaces=False,
    )
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
        tokenizer.add_tokens(list(ANSWER_TAGS))  # ordinary: they stay in decoded text
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_level(token: str) -> str:
    """Spell a vocabulary entry the way GPT-2 byte-level pre-tokenization does (space is 'Ġ',
    newline 'Ċ')."""
    return {" ": "\u0120", "\n": "\u010a"}.get(token, token)


def _save_model(out: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    ids = {token: index for index, token in enumerate(spec.vocab)}
    eos = ids[IM_END] if spec.chat else ids[EOS_TOKEN]
    config = Qwen2Config(
        vocab_size=len(spec.vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.hidden_size // ATTENTION_HEAD_DIM,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=eos,
        pad_token_id=ids[PAD_TOKEN],
        dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    torch.nn.Module.float(model)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=eos,
        pad_token_id=ids[PAD_TOKEN],
    )
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m rljob_workers.tinymodel OUT_DIR [--seed N ...]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--chat", action="store_true", help="the chat variant (ChatML template, wider alphabet)"
    )
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        chat=args.chat,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
