"""`portable_fsdp.train(...)` and the other API functions are served by the package's __getattr__, which Python asks
only for a name the package lacks: a sub-module of the same name, once imported, would take its place."""
import portable_fsdp
from tests.conftest import ROOT


def test_no_module_shadows_an_api_name():
    package = ROOT / "portable_fsdp"
    taken = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if p.is_dir()}
    assert not set(portable_fsdp._API) & taken
