"""What tests/warm.py's forkserver imports once, before it forks any rank: every module a train.py rank imports
before its first step in the suite's runs. Importing starts no thread and initialises no device or process group
(tests/unit/test_warm.py checks the forkserver holds one thread), so each fork begins as a fresh process would after
its imports."""
import importlib
import os

_BEFORE = dict(os.environ)

from tests.torchvision_side import activate  # noqa: E402

activate()  # torchvision for the vision families' processors, where the suite has it beside the venv

import datasets  # noqa: F401, E402
import deepspeed  # noqa: F401, E402
import peft  # noqa: F401, E402
import torch  # noqa: F401, E402
import torch.distributed  # noqa: F401, E402
import transformers  # noqa: F401, E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401, E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401, E402
from transformers.models.llama import modeling_llama  # noqa: F401, E402
from transformers.models.mixtral import modeling_mixtral  # noqa: F401, E402

import dstrain.cli  # noqa: F401, E402
import dstrain.parallel.dist  # noqa: F401, E402
import dstrain.run.watchdog  # noqa: F401, E402
import dstrain.trainer  # noqa: F401, E402

# imported later in a rank, each costing every launch again (py-spy over test_vs_reference + test_moe: 6.5% of all
# samples): the loss plot's pyplot at the run's end (rank 0, Agg as dstrain.metrics.plot_losses sets it),
# transformers' Mistral-format check that every AutoTokenizer load imports, DeepSpeed's op builders' setuptools
importlib.import_module("matplotlib").use("Agg")
for _name in ("matplotlib.pyplot", "setuptools", "transformers.integrations.mistral.tokenizer"):
    importlib.import_module(_name)

# what the imports set in the environment (tests/unit/test_warm.py compares it with warm._set_by_import)
ADDED = {name: value for name, value in os.environ.items() if _BEFORE.get(name) != value}
