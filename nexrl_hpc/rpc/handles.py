"""Handles: how a module on another rank looks to its callers (what an actor handle is under Ray).

A ``RemoteModuleHandle`` has one ``RemoteMethod`` per public method of the module's class, so
``execute(handle.put_trajectory, traj)`` reads the same as for a local object. A module passed as
an argument travels as a reference to its registered name; the receiving rank turns it back into
its own local object (colocated) or a handle (remote).
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nexrl_hpc.rpc.endpoint import RPC_MODULE, RpcEndpoint


def public_methods(cls: type) -> list[str]:
    return [name for name, member in inspect.getmembers(cls) if not name.startswith("_") and callable(member)]


class RemoteMethod:
    __slots__ = ("_endpoint", "_rank", "_module", "_name", "_timeout", "_quick")

    def __init__(
        self,
        endpoint: RpcEndpoint,
        rank: int,
        module: str,
        name: str,
        timeout: float | None = None,
        quick: bool = False,
    ):
        self._endpoint, self._rank, self._module, self._name = endpoint, rank, module, name
        self._timeout, self._quick = timeout, quick

    def call_async(self, *args: Any, **kwargs: Any) -> Future:
        return self._endpoint.call_async(
            self._rank, self._module, self._name, args, kwargs, self._timeout, quick=self._quick
        )

    def call_sync(self, *args: Any, **kwargs: Any) -> Any:
        """Call and wait; a ``@quick`` method is answered on this thread's own socket (no hand-offs)."""
        if self._quick:
            return self._endpoint.call_direct(
                self._rank, self._module, self._name, args, kwargs, self._timeout
            )
        return self.call_async(*args, **kwargs).result()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_sync(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<remote {self._module}.{self._name} on rank {self._rank}>"


class RemoteModuleHandle:
    """Mirror of a module hosted on ``rank`` under ``name``."""

    def __init__(self, endpoint: RpcEndpoint, rank: int, name: str, cls: type):
        self._name = name
        self._rank = rank
        self._cls = cls
        for method in public_methods(cls):
            quick = bool(getattr(getattr(cls, method), "__nexrl_quick__", False))
            setattr(self, method, RemoteMethod(endpoint, rank, name, method, quick=quick))
        self.get_module_name = lambda: name  # answered locally: the name is the address

    if TYPE_CHECKING:  # the module's public methods, set in __init__

        def __getattr__(self, name: str) -> RemoteMethod: ...

    @property
    def rank(self) -> int:
        return self._rank

    def __nexrl_handle_ref__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<{self._cls.__name__} {self._name!r} on rank {self._rank}>"


class ModuleRegistry:
    """The modules this rank hosts, by name; RPC requests are dispatched to their public methods."""

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}
        self._builtins: dict[str, Any] = {}

    def add(self, name: str, module: Any) -> None:
        if name in self._modules:
            raise ValueError(f"module name {name!r} registered twice")
        self._modules[name] = module

    def add_builtin(self, name: str, fn: Any) -> None:
        self._builtins[name] = fn

    def get(self, name: str) -> Any | None:
        return self._modules.get(name)

    def names(self) -> list[str]:
        return list(self._modules)

    def lookup(self, module: str, method: str) -> Any:
        """The bound method an RPC names (only public methods of registered modules, or built-ins)."""
        if module == RPC_MODULE:
            fn = self._builtins.get(method)
            if fn is None:
                raise AttributeError(f"no built-in RPC {method!r}")
            return fn
        target = self._modules.get(module)
        if target is None:
            raise LookupError(f"no module {module!r} here (hosted: {sorted(self._modules)})")
        if method.startswith("_"):
            raise PermissionError(f"{module}.{method} is not a public method")
        fn = getattr(target, method, None)
        if not callable(fn):
            raise AttributeError(f"{module} has no method {method!r}")
        return fn


class Directory:
    """Where every module of the run lives; resolves names to local objects or remote handles."""

    def __init__(
        self,
        rank: int,
        endpoint: RpcEndpoint,
        registry: ModuleRegistry,
        locations: dict[str, tuple[int, type]],
    ):
        self._rank = rank
        self._endpoint = endpoint
        self._registry = registry
        self._locations = locations
        self._handles: dict[str, RemoteModuleHandle] = {}

    def resolve(self, name: str) -> Any:
        local = self._registry.get(name)
        if local is not None:
            return local
        handle = self._handles.get(name)
        if handle is None:
            if name not in self._locations:
                raise LookupError(f"unknown module {name!r}")
            rank, cls = self._locations[name]
            handle = self._handles[name] = RemoteModuleHandle(self._endpoint, rank, name, cls)
        return handle

    def add(self, name: str, rank: int, cls: type) -> None:
        """A module that joined the run later (a joined rollout rank's): resolvable from now on."""
        if name in self._locations:
            raise ValueError(f"module name {name!r} is placed already")
        self._locations[name] = (rank, cls)

    def rank_of(self, name: str) -> int:
        return self._locations[name][0]
