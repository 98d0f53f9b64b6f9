"""What the families' tiny random-weight pipelines share: tokenizers built offline and an atomic save.

The real checkpoints cannot be downloaded here, so tests and the demo run on the same pipeline classes and loading
path as the real models, with layer sizes small enough for two CPU cores. The tokenizers are made with the
`tokenizers` library from fixed vocabularies (no training corpus, no merges), so two builds are identical; each
has the same kind of model as the real one (CLIP's BPE with `</w>`, T5's unigram, Qwen's byte-level BPE).
"""

from __future__ import annotations

import logging
import shutil
import string
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def clip_tokenizer():
    """CLIP's tokenizer class over single byte-level characters, each also with CLIP's end-of-word `</w>`.

    `model_max_length=77` as in the real one: the pipelines pad to it (the class's default is huge).
    """
    from transformers import CLIPTokenizer

    chars = _byte_alphabet()
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    """T5's tokenizer class with a small unigram vocabulary: word-initial pieces (`▁a`) and single characters."""
    from transformers import T5TokenizerFast

    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -1.0) for c in chars] + [(c, -1.5) for c in chars]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def qwen_tokenizer(chat_template: str | None = None):
    """Qwen2's tokenizer class over the byte-level alphabet (no merges), with Qwen's chat tokens."""
    from transformers import Qwen2TokenizerFast

    vocab = {t: i for i, t in enumerate(_byte_alphabet())}
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL[1:]})
    if chat_template:
        tok.chat_template = chat_template
    return tok


def save_atomically(pipe, out_dir, what: str) -> Path:
    """Write the pipeline to `out_dir` so that a half-built folder never appears there."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    pipe.save_pretrained(tmp, safe_serialization=True)
    try:
        tmp.rename(out)
    except OSError:
        # Another process built it first; theirs is identical (same seeds), so keep it.
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the tiny %s pipeline in %s", what, out)
    return out
