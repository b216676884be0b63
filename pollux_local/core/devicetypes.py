"""Device type names: one short, stable name per kind of GPU, from what NVML (or
``torch.cuda.get_device_name``) calls it and its memory.

The rule (:func:`gpu_type_name`):

1. The name is lower-cased and split into words at spaces, ``-`` and ``_``.
2. A word ``<N>gb`` is the memory size the name states; it is taken out.
3. Brand words (``nvidia``, ``tesla``, ``geforce``, ``quadro``, ``gpu``) and form factors
   (``sxm``/``sxm2``/..., ``pcie``, ``hbm``/``hbm2e``/..., ``nvl``, ``nvlink``, ``mig``) are
   dropped; what is left is joined without separators, letters and digits only: the model.
4. The model gets a memory suffix ``-<N>gb`` when the name states one, or, for a model sold in
   several sizes (``a100``, ``a800``, ``h100``, ``h800``, ``v100``, ``p100``) whose name does
   not, from the device's total memory rounded to the nearest marketed size.

So ``NVIDIA A100-SXM4-40GB`` is ``a100-40gb``, ``NVIDIA H100 PCIe`` with 80 GiB ``h100-80gb``,
``Tesla V100-SXM2-16GB`` ``v100-16gb``, ``Tesla T4`` ``t4``, ``Quadro RTX 6000`` ``rtx6000``
and ``NVIDIA GeForce RTX 2080 Ti`` ``rtx2080ti``.  Two cards get the same name exactly when
a job sees the same speed and memory on either (PCIe and SXM parts of one model are one type).
"""

from __future__ import annotations

import re

#: Words that name the vendor, the product line or the form factor, not the model.
IGNORED_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro", "gpu", "nvl", "nvlink", "mig"})
#: Form-factor words with a generation number: sxm4, hbm2e, pcie ...
IGNORED_PATTERN = re.compile(r"^(sxm\d*|pcie\d*|hbm\d*e?)$")
#: Models sold with several memory sizes: their type always names the size.
SIZED_MODELS = frozenset({"a100", "a800", "h100", "h800", "v100", "p100"})
#: Marketed memory sizes (GB) a measured total is rounded to.
MARKETED_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 141, 192)
#: The type of a device nothing is known about.
UNKNOWN_TYPE = "gpu"

_SIZE = re.compile(r"^(\d{1,4})gb$")


def marketed_gb(total_bytes: int) -> int:
    """The marketed size nearest (in ratio) to a measured total: 15 GiB -> 16, 79.6 GiB -> 80."""
    gib = max(total_bytes, 1) / 2**30
    return min(MARKETED_GB, key=lambda size: abs(size / gib - 1.0))


def gpu_type_name(name: str, total_bytes: int = 0) -> str:
    """The device type of a GPU called ``name`` with ``total_bytes`` of memory (the module's
    rule); ``gpu`` when the name leaves no model."""
    words = [w for w in re.split(r"[\s_-]+", name.strip().lower()) if w]
    stated: int | None = None
    model_words = []
    for word in words:
        size = _SIZE.match(word)
        if size:
            stated = int(size.group(1))
        elif word not in IGNORED_WORDS and not IGNORED_PATTERN.match(word):
            model_words.append(word)
    model = re.sub(r"[^a-z0-9]", "", "".join(model_words))
    if not model:
        return UNKNOWN_TYPE
    if stated is None and model in SIZED_MODELS and total_bytes > 0:
        stated = marketed_gb(total_bytes)
    return f"{model}-{stated}gb" if stated is not None else model
