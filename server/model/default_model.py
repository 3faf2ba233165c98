"""The embedded default model: a small Llama with a byte-level tokenizer.

Nothing is downloaded. The checkpoint is generated from a fixed seed, so every
machine builds bit-identical weights, and it is a plain HF checkpoint: vLLM and
transformers load it through exactly the code they use for any other model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# 256 byte tokens, then the specials. head_dim is 64: vLLM's CPU attention
# rejects 16.
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|reserved_1|>",
                  "<|reserved_2|>", "<|reserved_3|>", "<|reserved_4|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
SEED = 1234
# Bumped whenever the recipe changes, so a stale cache is rebuilt (it is part of
# the cache dir's name). r3: the chat template (/v1/chat/completions works out of
# the box); weights are unchanged, the seed regenerates them bit for bit.
RECIPE_VERSION = "3"
# ChatML-like turns. A turn ends with EOS, so a reply that stopped on EOS is
# followed by the same tokens when a later turn replays it. The text between
# the markers is plain bytes: the tokenizer maps every byte to one token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE with no merges: one token per byte, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # Order the byte alphabet by byte value, so token id == byte value.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (what ByteLevel uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_default_model(out: str | os.PathLike) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer) into `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID, torch_dtype="bfloat16", **MODEL_CONFIG)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    (out / "rollout_sidecar_recipe.txt").write_text(RECIPE_VERSION)
    return out


# Writing the model (random init in several threads) takes seconds.
WRITE_TIMEOUT_S = 600


def ensure_default_model(cache_dir: str | os.PathLike) -> Path:
    """Build the default model into `cache_dir` once; later calls reuse it.

    Built in a temp dir and renamed into place, so a crash mid-write never
    leaves a half checkpoint that a later start would try to serve. Written
    by a child process: torch's random init runs OpenMP's thread pool, and an
    engine core that vLLM forks from a process whose pool has run hangs at
    its first parallel op (GNU OpenMP is not fork-safe; vLLM forks on GPU,
    `vllm/utils/system_utils.py:get_mp_context`). The server's process
    never runs one before its engine starts.
    """
    target = Path(cache_dir) / f"default-llama-r{RECIPE_VERSION}"
    if (target / "rollout_sidecar_recipe.txt").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        subprocess.run([sys.executable, "-c", "import sys; from rollout_sidecar.server.model."
                        "default_model import write_default_model as w; w(sys.argv[1])",
                        str(tmp)], check=True, timeout=WRITE_TIMEOUT_S)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
