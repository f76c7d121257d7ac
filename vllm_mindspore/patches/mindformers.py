"""The mindformers group of the patch registry: what MindSpore Transformers' inference classes
need to import and run here, applied only by the MindFormers model backend (never in the API
server, which does not import mindformers).

- `MODULE_STUBS`: training-only packages mindformers imports unconditionally at `import
  mindformers` (metrics, datasets, fine-tuning, pynative training) and which its inference path
  never calls. Each is declared with the module that imports it. An empty module is made only for
  a declared name that is really missing; an installed package is always the real one.
- `MINDFORMERS_PATCHES`: on CPU, where MindSpore registers none of the fused Ascend kernels the
  mcore cells call, the cells run this project's CPU kernels instead
  (`model_backends.mindformers.cpu_substitutes`). On Ascend nothing is substituted.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from vllm_mindspore.patches import Patch, apply, suspended

MINDFORMERS_VERSION = "2.0.0"  # also pinned in scripts/versions.env (the install recipe)

INSTALL_HINT = "run make install-mindformers (or scripts/install.sh --with-mindformers)"


class MindFormersUnavailableError(RuntimeError):
    pass


@dataclass(frozen=True)
class ModuleStub:
    name: str  # top-level module made empty when it is not installed
    importer: str  # the mindformers module importing it at package import time


MODULE_STUBS = (
    ModuleStub("jieba", "mindformers.core.metric.metric"),
    ModuleStub("rouge_chinese", "mindformers.core.metric.metric"),
    ModuleStub("nltk", "mindformers.core.metric.metric"),
    ModuleStub("datasets", "mindformers.dataset.dataloader.hf_dataloader"),
    ModuleStub("pyarrow", "mindformers.dataset.dataloader.training_dataloader"),
    ModuleStub("mindpet", "mindformers.pet.tuners.pet_adapter"),
    ModuleStub("tensorboardX", "mindformers.utils.tensorboard"),
    ModuleStub("hyper_parallel", "mindformers.pynative (imported by mindformers.models.deepseek4)"),
)


class _StubModule(types.ModuleType):
    """Every attribute exists: a class for a CamelCase name (importers subclass some of them),
    else a function; using either at import time is all the importers do."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        return lambda *args, **kwargs: None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: frozenset[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_stubbed: frozenset[str] | None = None


def install_module_stubs() -> frozenset[str]:
    """Stub the declared modules that are not installed (once) -> their names."""
    global _stubbed
    if _stubbed is None:
        _stubbed = frozenset(stub.name for stub in MODULE_STUBS
                             if stub.name not in sys.modules
                             and importlib.util.find_spec(stub.name) is None)
        if _stubbed:
            sys.meta_path.append(_StubFinder(_stubbed))
    return _stubbed


def _on_cpu() -> bool:
    from vllm_mindspore.platform import ASCEND, kernel_device

    return kernel_device() != ASCEND


def _substitute(name: str):
    """The replacement factory `name` of cpu_substitutes (imported when the patch is applied)."""
    def replacement(original):
        from model_backends.mindformers import cpu_substitutes

        return getattr(cpu_substitutes, name)(original)

    return replacement


_INFERENCE = "mindformers.parallel_core.inference"

MINDFORMERS_PATCHES: list[Patch] = [
    Patch(target=f"{_INFERENCE}.transformer.norm:RMSNorm.__init__", reason=(
        "RMSNorm (the decoder norms and Qwen3's q/k norms) calls P.RmsNorm, which has no CPU "
        "kernel in MindSpore 2.10: its `norm` primitive becomes this project's RmsNorm kernel "
        "(same call and float32 math; mf's construct and weights stay)."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("rms_norm_init"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.base_models.common.embeddings.rotary_pos_embedding:"
                 "RotaryEmbedding.__init__", reason=(
        "RotaryEmbedding (and its Llama3/YaRN/partial subclasses) calls ApplyRotaryPosEmb, "
        "which has no CPU kernel: its `rotary_embedding_op` becomes this project's RopeNeox "
        "kernel over mf's own per-token cos/sin rows (the backend keeps GPTModel on the "
        "gather-by-position path), so mf's tables, scaling and partial rotation stay."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("rotary_init"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.transformer.flash_attention:FlashAttention.construct", reason=(
        "FlashAttention calls ReshapeAndCache, FlashAttentionScore and PagedAttention, none of "
        "which has a CPU kernel: it runs this project's PagedAttention CPU kernel over the "
        "caches the backend binds to the cell, which writes the step's keys/values and attends "
        "every request of a packed step (prefills, chunks, prefix hits, decodes) in one call."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("paged_attention_construct"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.transformer.moe.router:TopKRouter.routing", reason=(
        "TopKRouter's routing (topk_routing_with_score_function) calls TopkExt (mint.topk), "
        "InplaceScatter and RepeatInterleaveInt, which have no CPU kernel: the same routing "
        "(score function, expert bias for the choice only, mf's group ranking and 0.0 mask, "
        "normalisation and scaling) is made of TopK, OneHot, Select and GatherElements."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("topk_routing"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.transformer.moe.moe_layer:MoELayer.construct", reason=(
        "MoELayer dispatches through MoeInitRoutingV2, IndexSelect, GroupedMatmulV4 and "
        "MoeTokenUnpermute, which have no CPU kernel: the router's choice runs this project's "
        "MoeExperts CPU kernel (each expert over exactly its tokens, weighted sum back) on the "
        "GroupedMLP weights packed after loading; the shared experts and the tensor-parallel "
        "reduction stay mf's."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("moe_layer_construct"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.transformer.multi_latent_attention:MLASelfAttention.construct",
          reason=(
        "MLASelfAttention writes its latent with ReshapeAndCache and attends with "
        "FlashAttentionScore (prefill) or PagedAttention's MLA mode, none of which has a CPU "
        "kernel: mf's own compute_kv (projections, norms, rope) feeds this project's MLA CPU "
        "kernel, which caches the latent and attends every request of a packed step with "
        "mf's absorbed W_UK / W_UV and softmax scale."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("mla_construct"), when=_on_cpu),
    Patch(target=f"{_INFERENCE}.parallel_state:ProcessGroup.__init__", reason=(
        "initialize_model_parallel names its tensor-parallel group 'tp-0-1' (and creates it) "
        "even when it spans the whole MindSpore world, but MindSpore's CPU AllGather (the "
        "output layer's gather) runs only on the world group: a group spanning the world is "
        "named as the world group."),
          package="mindformers", version=MINDFORMERS_VERSION,
          replacement=_substitute("world_group_init"), when=_on_cpu),
]


def installed_version() -> str | None:
    try:
        return version("mindformers")
    except PackageNotFoundError:
        return None


def apply_mindformers_patches() -> None:
    """Make `import mindformers` work and apply the CPU substitutes (idempotent). Refuses a
    mindformers other than the version the patches were written against."""
    found = installed_version()
    if found is None:
        raise MindFormersUnavailableError(f"mindformers not installed: {INSTALL_HINT}.")
    if found.split("+")[0] != MINDFORMERS_VERSION:
        raise MindFormersUnavailableError(
            f"mindformers {found} is installed, but vllm-mindspore's adapter and its patches "
            f"are written against mindformers {MINDFORMERS_VERSION}: {INSTALL_HINT}.")
    # mindformers writes its log files under ./output of the working directory unless told.
    os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(
        os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "vllm-mindspore",
        "mindformers"))
    install_module_stubs()
    apply(MINDFORMERS_PATCHES)


def cpu_substitutes_suspended():
    """Context: mindformers' own cells and ops (no CPU substitute), in a CPU process where
    `apply_mindformers_patches` applied them earlier; build and compile for Ascend inside it."""
    return suspended(MINDFORMERS_PATCHES)
