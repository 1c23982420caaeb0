"""What the ``metadispatch`` command loads before it parses its arguments: none of torch's distributed
training stack (FSDP2, DTensor, tensor parallelism; about a second of imports here), which only ``--fsdp``,
``--tp``, ``--pp`` and ``plan`` use -- they import it when they run (cli/plan.py)."""

import os
import subprocess
import sys

import metadispatch as md

_CODE = (
    "import sys\n"
    "import metadispatch.cli.main\n"
    "heavy = ('torch.distributed.fsdp', 'torch.distributed.tensor', 'torch.distributed.pipelining',\n"
    "         'torch._dynamo', 'transformers')\n"
    "assert [h for h in heavy if h in sys.modules] == [], [h for h in heavy if h in sys.modules]\n"
)


def test_the_command_imports_no_distributed_training_stack_before_it_runs():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(md.__file__))))
    subprocess.run([sys.executable, "-c", _CODE], check=True, env=env)
