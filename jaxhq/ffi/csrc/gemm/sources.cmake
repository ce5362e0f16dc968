# GEMM handlers (jaxhq/ffi/csrc/gemm), for the CUDA build of _jaxhq_ffi.
# cuBLASLt is loaded at run time with dlopen (no cuBLAS headers or libraries are needed to build), so the
# only extra link dependency is libdl. The wgmma kernels (FP8/MXFP8, NVFP4) are hand-written PTX; their TMA
# descriptors are encoded through the runtime's driver entry point (no libcuda link). The CUTLASS sources build
# only where CUTLASS's headers are found (CMakeLists.txt).
set(JAXHQ_GEMM_DIR "${CMAKE_CURRENT_LIST_DIR}")
set(JAXHQ_GEMM_SOURCES
    "${JAXHQ_GEMM_DIR}/gemm_handlers.cc"
    "${JAXHQ_GEMM_DIR}/cublaslt.cc"
    "${JAXHQ_GEMM_DIR}/gemm_kernels.cu"
    "${JAXHQ_GEMM_DIR}/fp8_wgmma.cu"
    "${JAXHQ_GEMM_DIR}/nvfp4_wgmma.cu")
# two files, so the build compiles the kernels of each in parallel (cutlass_grouped.cuh)
set(JAXHQ_GEMM_CUTLASS_SOURCES "${JAXHQ_GEMM_DIR}/fp8_cutlass_grouped.cu"
    "${JAXHQ_GEMM_DIR}/fp8_cutlass_grouped_tensor.cu")
set(JAXHQ_GEMM_INCLUDES "${JAXHQ_GEMM_DIR}")
set(JAXHQ_GEMM_LIBS ${CMAKE_DL_LIBS})
