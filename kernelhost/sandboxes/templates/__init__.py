"""Templates: the user's own environments, from a spec to an image and its snapshot.

- ``spec``: ``TemplateSpec``, ``parse_spec``: every field checked, the canonical form the key hashes;
- ``builds``: ``Build``, ``BuildQueue``: builds off the request path, bounded, with a deadline each;
- ``service``: ``TemplateService``, ``OperatorTemplates``: which a key may use, resolve, submit, delete;
- ``stages``: ``run_build``: one build's stages (base, layer, manifest, snapshot, link);
- ``build_vm``: the build VM, where a tenant's layer is built (never on the host);
- ``views``: ``TemplateView``: what a template looks like to users; ``KERNEL_PACKAGES``.

The records are in ``store/templates.py``.
"""

from .spec import DISTRIBUTION_PREFIX, SpecError, TemplateSpec, parse_spec, spec_from_wire

__all__ = ["DISTRIBUTION_PREFIX", "SpecError", "TemplateSpec", "parse_spec", "spec_from_wire"]
