// The build identity of a program: kda_kcp.jit compiles it in as -DKDA_BUILD_IDENTITY="..." (program, arch,
// package version, hashes of the sources and flags, nvcc and tvm_ffi versions) and compares build_identity()
// with what it expects before it uses the program, so that a stale or foreign .so is never run.
// Each program's binding file exports it once: KDA_EXPORT_BUILD_IDENTITY();
#pragma once

#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#ifndef KDA_BUILD_IDENTITY
#define KDA_BUILD_IDENTITY ""  // compiled outside kda_kcp.jit: the loader refuses the program
#endif

namespace kda {
inline tvm::ffi::String build_identity() { return tvm::ffi::String(KDA_BUILD_IDENTITY); }
}  // namespace kda

#define KDA_EXPORT_BUILD_IDENTITY() TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_identity, kda::build_identity)
