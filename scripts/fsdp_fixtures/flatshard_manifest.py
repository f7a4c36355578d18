#!/usr/bin/python3
"""Export an ``nn.Module`` tree to a flatshard manifest (``flatshard.manifest/1``).

See shared/spec/formats.md.  Usage as a library::

    from flatshard_manifest import manifest_from_module
    doc = manifest_from_module(model)

or from the command line (prints the JSON on stdout)::

    /usr/bin/python3 scripts/fsdp_fixtures/flatshard_manifest.py some.module:factory [--indent N]

``factory`` is called with no arguments and must return an ``nn.Module``; the
directory of this script and the current directory are on ``sys.path``, so
``models:gpt_tied`` works for the example models in ``models.py``.

A thin wrapper: the exporter is ``flatshard.torch.manifest_of``
(client/python/flatshard/torch/manifest.py), loaded here by path so that this
script needs only torch. Rules (formats.md):
- modules are numbered per *instance* in pre-order (registration order); a
  module instance registered at several paths is written in full at its first
  occurrence and as ``{"ref": id}`` everywhere else;
- ``type`` is the class name, ``bases`` the names of the ``nn.Module``
  subclasses in ``type(m).__mro__[1:]`` (nearest first);
- ``params``/``buffers`` are the tensors registered directly on the module
  (``_parameters`` / ``_buffers``, registration order, ``None`` entries
  skipped, duplicates kept), each with a tensor id that is the same for the
  same tensor object wherever it is registered.  Params and buffers share one
  id space; ids are assigned in order of first appearance.
"""
import importlib.util
import os
import sys
from typing import List

import torch.nn as nn

# The exporter lives in the flatshard Python package (client/python/flatshard/torch/manifest.py,
# one home). It is loaded by path: it needs only torch, not the built extension.
_HERE = os.path.dirname(os.path.abspath(__file__))
_IMPL = os.path.join(_HERE, "..", "..", "client", "python", "flatshard", "torch", "manifest.py")
_spec = importlib.util.spec_from_file_location("_flatshard_torch_manifest", _IMPL)
_impl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_impl)

FORMAT = _impl.FORMAT
dtype_name = _impl.dtype_name
module_bases = _impl.module_bases
manifest_from_module = _impl.manifest_from_module
dumps = _impl.dumps


def _load_factory(spec: str):
    import importlib

    sys.dont_write_bytecode = True
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    for p in (here, os.getcwd()):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise SystemExit(f"expected module.path:factory, got {spec!r}")
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: List[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("factory", help="module.path:callable returning an nn.Module")
    ap.add_argument("--indent", type=int, default=1)
    args = ap.parse_args(argv)
    factory = _load_factory(args.factory)
    model = factory() if not isinstance(factory, nn.Module) else factory
    if not isinstance(model, nn.Module):
        raise SystemExit(f"{args.factory} did not return an nn.Module")
    sys.stdout.write(dumps(manifest_from_module(model), args.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
