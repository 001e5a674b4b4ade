"""``python -m rljob_operator`` runs the controller (same as ``rljob-operator``)."""

import sys

from rljob_operator.cli import operator_main

sys.exit(operator_main())
