"""mosaicml-streaming without its dataset zoo at import.

`import streaming` runs the package's `__init__`, which imports `streaming.text` and
`streaming.vision` for their named datasets (C4, the Pile, ImageNet...): they pull in
transformers' auto classes and torchvision, close to a third of the library's import time
(benchmarks/bench_imports.py), in every process that writes or reads MDS (preprocess workers,
Ray workers, training ranks), for classes mixlen never uses. (`streaming.base` itself still
imports transformers' core, for two isinstance checks in its data loader.)

`light_streaming()` registers those two subpackages as stand-ins before the library is first
imported: a stand-in has the package's file, path and spec, and runs the package's own `__init__`
at the first other attribute asked of it, so code that does use them still works. (The standard
library's `LazyLoader` is not enough: `inspect.getmodule`, which torch calls while it imports, asks
every module for `__file__`.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from importlib.machinery import ModuleSpec

__all__ = ["LAZY", "light_streaming"]

# the library's subpackages imported only for their named datasets
LAZY = ("streaming.text", "streaming.vision")


def _stand_in(spec: ModuleSpec) -> types.ModuleType:
    """A module that is `spec`'s package once anything but its identity is asked of it."""
    module = importlib.util.module_from_spec(spec)  # sets __file__, __path__, __spec__, ...

    def load(attr: str) -> object:
        del module.__dict__["__getattr__"]
        assert spec.loader is not None
        spec.loader.exec_module(module)  # the package's __init__, in this module
        return getattr(module, attr)

    module.__getattr__ = load  # type: ignore[method-assign]  # PEP 562: unknown names only
    return module


def light_streaming() -> None:
    """Call before the first `import streaming...` of a process; a no-op once it is imported."""
    if "streaming" in sys.modules:
        return
    spec = importlib.util.find_spec("streaming")  # finds it without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import that follows says so
    root = list(spec.submodule_search_locations)[0]
    for name in LAZY:
        folder = os.path.join(root, name.rsplit(".", 1)[1])
        init = os.path.join(folder, "__init__.py")
        if name in sys.modules or not os.path.isfile(init):
            continue  # another layout of the library: imported as it is
        sub = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[folder]
        )
        if sub is not None and sub.loader is not None:
            sys.modules[name] = _stand_in(sub)
