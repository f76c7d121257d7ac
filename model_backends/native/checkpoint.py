"""Which files a HF safetensors checkpoint is. Pure Python (no MindSpore, no torch), so vLLM's
front-end process checks a model folder at start-up, before any worker starts."""

import json
import os


class WeightLoadError(ValueError):
    pass


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: the shards an index names (each must exist), else every
    *.safetensors file of the folder."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise WeightLoadError(
                f"Cannot read the checkpoint index {index!r} ({type(error).__name__}: {error}): "
                "it must be JSON with a 'weight_map' of tensor name -> shard file.") from error
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise WeightLoadError(
                f"Shard(s) {missing} named by {index!r} are missing from {model_dir!r}: the "
                "checkpoint is incomplete (an interrupted download?).")
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(
            f"No *.safetensors weights in {model_dir!r}. vllm-mindspore reads HF safetensors "
            "checkpoints (model.safetensors or model-0000x-of-0000y.safetensors + index).")
    return [os.path.join(model_dir, f) for f in files]
