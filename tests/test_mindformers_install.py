"""The optional mindformers package: `import mindformers` works on this stack with the declared
training-only stubs, its mcore registry holds the architectures the MindFormers backend maps,
and processes that do not build a mindformers model never import it."""

import json
import subprocess
import sys

from conftest import ROOT, needs_mindformers

pytestmark = needs_mindformers()


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter -> the last JSON line it prints. MindSpore may print
    after it at exit ("[MS_ALLOC_CONF] config: ..." once mindformers' build_mf_context, run by
    an earlier test in this process, has set MS_ALLOC_CONF in the inherited environment)."""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(next(line for line in reversed(result.stdout.splitlines())
                           if line.startswith("{")))


def test_import_mindformers_lists_the_mcore_models():
    found = run_python("""
import importlib.util, json, sys
from vllm_mindspore.patches.mindformers import MODULE_STUBS, apply_mindformers_patches
missing = sorted(s.name for s in MODULE_STUBS if importlib.util.find_spec(s.name) is None)
apply_mindformers_patches()
import mindformers
from mindformers.tools.register.register import MindFormerModuleType, MindFormerRegister
models = MindFormerRegister.registry[MindFormerModuleType.MODELS]
stubbed = sorted(n for n in (s.name for s in MODULE_STUBS)
                 if n in sys.modules and not getattr(sys.modules[n], "__file__", None))
print(json.dumps({"missing": missing, "stubbed": stubbed,
                  "mcore": sorted(n for n in models if n.startswith("mcore_")),
                  "deprecated": sys.modules["deprecated"].__file__}))
""")
    assert {"mcore_Qwen2ForCausalLM", "mcore_Qwen3ForCausalLM", "mcore_Qwen3MoeForCausalLM",
            "mcore_DeepseekV3ForCausalLM"} <= set(found["mcore"])
    # Only declared names that are really missing are stubbed; `deprecated` is the real package.
    assert set(found["stubbed"]) <= set(found["missing"])
    assert "site-packages" in found["deprecated"]


def test_stubs_never_shadow_an_installed_module():
    found = run_python("""
import json
from vllm_mindspore.patches import mindformers as patches
patches.MODULE_STUBS += (patches.ModuleStub("yaml", "<test>"),)
stubbed = patches.install_module_stubs()
import yaml
print(json.dumps({"stubbed": sorted(stubbed), "yaml": yaml.__file__}))
""")
    assert "yaml" not in found["stubbed"] and found["yaml"].endswith(".py")


def test_configuration_step_does_not_import_mindformers():
    """The platform's MindFormers configuration step runs in every vLLM process, the API
    server's included: only building a model imports the package."""
    found = run_python("""
import json, sys
import vllm_mindspore
vllm_mindspore.register_general()
import vllm_mindspore.platform, model_backends.mindformers, model_backends.mindformers.backend
print(json.dumps({"imported": "mindformers" in sys.modules}))
""")
    assert found == {"imported": False}
