"""How far a model variant (FP8 weights) drifts from its reference, measured on a fixed text.

``measure_fp8_accuracy`` loads a model twice (reference dtype, and FP8 weights with the same
activation dtype), runs both over the same token sequence in one prefill, and compares their
next-token logits: mean and max absolute error, how often their top tokens agree, and the
perplexity each assigns to the text. ``bench/engine.py`` reports these for the FP8 mode.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .attention.base import AttentionMetadata

# A fixed text of ordinary prose and a little code (written for this purpose), long enough for a
# few hundred tokens: the same text on every run makes the figures comparable across runs.
FIXED_TEXT = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his
father had taught him: one hundred and twelve, no more and no less. At the top he wiped the salt
from the great lens, trimmed the wick, and watched the beam sweep out across the grey water. Ships
he would never meet steered by that light, and he liked to think that somewhere a sailor was glad
of it. In winter the storms came in from the west and rattled the windows until dawn; in summer
the sea lay flat and silver, and children from the village rowed out to wave at him.

A short function that counts how often each word appears in a text:

def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts

Water boils at one hundred degrees Celsius at sea level, but at lower temperatures high in the
mountains, because the air pressure there is lower. That is why pasta takes longer to cook in a
mountain hut, and why climbers carry pressure cookers on long expeditions.
"""


@dataclass(frozen=True)
class LogitComparison:
    num_tokens: int
    mean_abs_logit_error: float
    max_abs_logit_error: float
    top1_agreement: float  # share of positions whose argmax token is the same
    perplexity_reference: float
    perplexity_variant: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def sequence_logits(model, token_ids: list[int], *, block_size: int = 16) -> torch.Tensor:
    """Float32 next-token logits [len(token_ids), vocab] of one sequence, in one prefill over a
    fresh paged cache on the model's device."""
    if not token_ids:
        raise ValueError("token_ids is empty")
    cfg = model.config
    device = model.embed.device
    dtype = model.embed.dtype
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                  torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),  # blocks in order
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        max_query_len=n,
        max_context_len=n,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(n, device=device), meta, kv_caches)
    return model.compute_logits(hidden)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token given the ones before it."""
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return math.exp(F.cross_entropy(logits[:-1].float(), targets).item())


def compare_logits(reference: torch.Tensor, variant: torch.Tensor,
                   token_ids: list[int]) -> LogitComparison:
    error = (variant.float() - reference.float()).abs()
    agreement = (variant.argmax(-1) == reference.argmax(-1)).float().mean()
    return LogitComparison(
        num_tokens=len(token_ids),
        mean_abs_logit_error=error.mean().item(),
        max_abs_logit_error=error.max().item(),
        top1_agreement=agreement.item(),
        perplexity_reference=perplexity(reference, token_ids),
        perplexity_variant=perplexity(variant, token_ids),
    )


def measure_fp8_accuracy(path: str | os.PathLike | None = None, *, scheme: str = "fp8",
                         device: str = "cpu", dtype: torch.dtype | None = None,
                         text: str = FIXED_TEXT) -> dict:
    """FP8 weights against the same model in ``dtype`` (bfloat16 on CUDA, float32 elsewhere) on
    ``text``; ``path`` defaults to the bundled model. Returns a JSON-ready dict: the settings and
    the ``LogitComparison`` fields (the variant is the FP8 model)."""
    from .loader import bundled_model_path, load_model

    path = bundled_model_path() if path is None else path
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    reference = load_model(path, dtype=dtype, device=device)
    token_ids = reference.tokenizer.encode(text)[: reference.config.max_position_embeddings]
    reference_logits = sequence_logits(reference.model, token_ids)
    del reference
    quantized = load_model(path, dtype=dtype, device=device, quantization=scheme)
    comparison = compare_logits(reference_logits, sequence_logits(quantized.model, token_ids),
                                token_ids)
    return {"scheme": scheme, "reference_dtype": str(dtype).removeprefix("torch."),
            "device": str(device), **comparison.as_dict()}
