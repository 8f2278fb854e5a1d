from helix.parallel.comm import Comm, LocalComm, TorchComm
from helix.parallel.mesh import Mesh

__all__ = ["Comm", "LocalComm", "TorchComm", "Mesh"]
