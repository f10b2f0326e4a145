"""Templates: the user's own environments. A spec (``spec.py``) is built into a layer over a
built image (``guest-image/layer.py``) by ``builds.py``; ``catalog.py`` keeps the records, who
owns what, and resolves a name to the image a sandbox starts from."""

from .spec import DISTRIBUTION_PREFIX, SpecError, TemplateSpec, parse_spec, spec_from_wire

__all__ = ["DISTRIBUTION_PREFIX", "SpecError", "TemplateSpec", "parse_spec", "spec_from_wire"]
