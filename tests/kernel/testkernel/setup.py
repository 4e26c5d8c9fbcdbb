# A deliberately tiny CUDA extension for the kernel tier: real nvcc + real torch headers,
# about a minute to build, so failure paths (kill mid-compile, missing arch) are cheap.
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

# Like causal-conv1d, the arch list comes from a package-specific knob; HARDCODED_ARCH
# (set by the test that builds a broken variant) ignores it, as upstream packages do.
archs = os.environ.get("TESTKERNEL_CUDA_ARCHS", "90").split(";")
HARDCODED_ARCH = None
if HARDCODED_ARCH:
    archs = [HARDCODED_ARCH]
gencodes = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]

setup(
    name="ftimage-testkernel",
    version="0.1.0",
    ext_modules=[CUDAExtension("ftimage_testkernel_cuda", ["binding.cpp", "kernel.cu"],
                               extra_compile_args={"cxx": ["-O1"], "nvcc": ["-O1", *gencodes]})],
    cmdclass={"build_ext": BuildExtension},
)
