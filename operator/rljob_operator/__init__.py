"""rljob-operator: the Kubernetes controller for RLJob objects."""

__version__ = "0.1.0"
