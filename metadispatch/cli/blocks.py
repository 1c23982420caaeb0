"""The blocks a distributed plan wraps: ``fully_shard`` units and tensor-parallel layers.

Note [Finding a model's blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A real FSDP2 script shards each repeated block (``model.layers`` of a
LLaMA, GPT-2's ``transformer.h``, a ViT's ``blocks``, a ResNet's
bottlenecks) and then the root.  The blocks are found as a script's author
finds them: the container (``ModuleList`` or ``Sequential``) of at least two
children of one class holding the most parameters; its children's class is
the block, and every module of that class in such a container is a block
(a ResNet's four stages each hold some).  ``--blocks PATH`` names the
container instead (``transformer.h``).

Tensor parallelism needs to know which linears split by output (colwise)
and which by input (rowwise), and which attributes count heads: LLaMA-style
names (``q/k/v/o_proj``, ``gate/up/down_proj``) and MLPs named ``fc1``/
``fc2`` (timm, CLIP) are known; a block with none of them is refused, since
a fused ``qkv`` split colwise would mix queries and keys across ranks.
"""

from __future__ import annotations

from torch import nn

from .targets import UsageError

__all__ = ["find_blocks", "tp_layers", "COLWISE", "ROWWISE"]

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1")
ROWWISE = ("o_proj", "down_proj", "fc2")
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_blocks(model: nn.Module, path: str | None = None) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` for every block of ``model`` (Note [Finding a model's blocks])."""
    if path is not None:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise UsageError(f"--blocks {path}: {type(model).__name__} has no module {path!r}") from None
        blocks = [(f"{path}.{n}", m) for n, m in container.named_children()]
        if not blocks:
            raise UsageError(f"--blocks {path}: {type(container).__name__} has no children to wrap")
        return blocks
    best, size = None, 0
    for _name, m in model.named_modules():
        kind = _block_kind(m)
        if kind is not None and (n := _params(m)) > size:
            best, size = kind, n
    if best is None:
        raise UsageError(
            f"{type(model).__name__}: no list of repeated blocks to wrap; name it with --blocks (e.g. --blocks layers)"
        )
    found = []
    for name, m in model.named_modules():
        if _block_kind(m) is best:
            found += [(f"{name}.{n}" if name else n, c) for n, c in m.named_children()]
    return found


def _block_kind(m: nn.Module) -> type | None:
    """The class of ``m``'s children if ``m`` is a container of two or more of one class with parameters."""
    if not isinstance(m, _CONTAINERS):
        return None
    kinds = {type(c) for c in m.children()}
    if len(m) < 2 or len(kinds) != 1 or isinstance(next(iter(m.children())), _CONTAINERS):
        return None
    return kinds.pop() if all(_params(c) for c in m.children()) else None


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def tp_layers(block: nn.Module) -> dict:
    """Name within ``block`` -> ``"colwise"`` or ``"rowwise"``, for each linear tensor parallelism splits."""
    plan = {}
    for name, m in block.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(m, nn.Linear) and leaf in COLWISE + ROWWISE:
            plan[name] = "colwise" if leaf in COLWISE else "rowwise"
    return plan
