"""`python -m vcpo.trainer ARGS` is `vcpo train ARGS`: the entry point of every rank under
`torchrun --nproc-per-node N -m vcpo.trainer ARGS` (docs/trainer.md, "Trainer ranks")."""

import sys

from vcpo.trainer.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
