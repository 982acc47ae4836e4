# Generates, from the configuration list (cuda/configs.txt), one CUDA translation unit per (family, pass,
# dtype, head dim) that instantiates that family's launcher, and dispatch.cc: the list as a C++ array and the
# one switch from a runtime (family, dtype, head dim) to its instantiation, per pass. Files are rewritten
# only when their content changes, so an unchanged list recompiles nothing. The units of family F are
# returned in <sources_prefix>_F; families not in `enabled_families` and dtypes not in `enabled_dtypes` (lists)
# are left out altogether.
function(jaxflash_generate_configs list_file out_dir enabled_families enabled_dtypes sources_prefix dispatch_var)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${list_file})
  file(STRINGS ${list_file} lines REGEX "^[ \t]*[^# \t]")
  set(families "")
  set(array "")
  set(count 0)
  set(cases_fwd "")
  set(cases_bwd "")
  set(cases_decode "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "[ \t]+" ";" fields "${line}")
    list(POP_FRONT fields family pass dtype)
    if(NOT family MATCHES "^(sm80|sm90|decode)$" OR NOT pass MATCHES "^(fwd|bwd)$" OR NOT dtype MATCHES "^(bfloat16|float16)$"
       OR fields STREQUAL "")
      message(FATAL_ERROR "jaxflash: ${list_file}: expected 'family pass dtype head_dim...' with family sm80|sm90|decode, "
                          "pass fwd|bwd, dtype bfloat16|float16; got '${line}'")
    endif()
    if(NOT family IN_LIST enabled_families OR NOT dtype IN_LIST enabled_dtypes)
      continue()
    endif()
    list(APPEND families ${family})
    if(family STREQUAL "decode")
      set(fam_enum "kDecode")
    else()
      string(TOUPPER "${family}" fam_upper)
      string(REPLACE "SM" "kSm" fam_enum "${fam_upper}")
    endif()
    if(dtype STREQUAL "bfloat16")
      set(dtype_enum "DType::kBF16")
    else()
      set(dtype_enum "DType::kF16")
    endif()
    # The decode family has one entry point, run_decode, on DecodeParams (split-KV workspaces, block table).
    if(family STREQUAL "decode" AND pass STREQUAL "fwd")
      set(params "DecodeParams")
      set(pass_enum "Pass::kFwd")
      set(case_list "decode")
    elseif(pass STREQUAL "fwd")
      set(params "FwdParams")
      set(pass_enum "Pass::kFwd")
      set(case_list "fwd")
    else()
      set(params "BwdParams")
      set(pass_enum "Pass::kBwd")
      set(case_list "bwd")
    endif()
    if(family STREQUAL "decode" AND NOT pass STREQUAL "fwd")
      message(FATAL_ERROR "jaxflash: ${list_file}: the decode family has a forward pass only; got '${line}'")
    endif()
    foreach(d IN LISTS fields)
      if(NOT d MATCHES "^[0-9]+$")
        message(FATAL_ERROR "jaxflash: ${list_file}: head dim '${d}' is not a number in '${line}'")
      endif()
      set(tu "${out_dir}/${family}_${pass}_${dtype}_hdim${d}.cu")
      file(CONFIGURE OUTPUT ${tu} CONTENT
"// Generated from cuda/configs.txt by cuda/configs.cmake; do not edit.
#include \"${family}/launch_${pass}.cuh\"

template cudaError_t jaxflash::${family}::run_${pass}<jaxflash::${dtype_enum}, ${d}>(
    const jaxflash::${params}&, cudaStream_t, int);
")
      list(APPEND sources_${family} ${tu})
      string(APPEND array "    {Family::${fam_enum}, ${pass_enum}, ${dtype_enum}, ${d}},\n")
      string(APPEND cases_${case_list}
        "    case key(Family::${fam_enum}, ${dtype_enum}, ${d}): return ${family}::run_${pass}<${dtype_enum}, ${d}>(p, stream, device);\n")
      math(EXPR count "${count} + 1")
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES families)
  set(includes "")
  foreach(family IN LISTS families)
    string(APPEND includes "#include \"${family}/launch.h\"\n")
  endforeach()
  set(dispatch "${out_dir}/dispatch.cc")
  file(CONFIGURE OUTPUT ${dispatch} CONTENT
"// Generated from cuda/configs.txt by cuda/configs.cmake; do not edit.
#include \"dispatch.h\"
${includes}
namespace jaxflash {

const Config kCompiledConfigs[] = {
${array}};
const int kNumCompiledConfigs = ${count};

namespace {
constexpr int key(Family family, DType dtype, int head_dim) {
  return (static_cast<int>(family) * 4 + static_cast<int>(dtype)) * 4096 + head_dim;
}
}  // namespace

cudaError_t run_fwd(Family family, DType dtype, int head_dim, const FwdParams& p, cudaStream_t stream, int device) {
  switch (key(family, dtype, head_dim)) {
${cases_fwd}    default: return cudaErrorNotSupported;
  }
}

cudaError_t run_bwd(Family family, DType dtype, int head_dim, const BwdParams& p, cudaStream_t stream, int device) {
  switch (key(family, dtype, head_dim)) {
${cases_bwd}    default: return cudaErrorNotSupported;
  }
}

cudaError_t run_decode(DType dtype, int head_dim, const DecodeParams& p, cudaStream_t stream, int device) {
  switch (key(Family::kDecode, dtype, head_dim)) {
${cases_decode}    default: return cudaErrorNotSupported;
  }
}

}  // namespace jaxflash
")
  foreach(family IN LISTS families)
    set(${sources_prefix}_${family} ${sources_${family}} PARENT_SCOPE)
  endforeach()
  set(${dispatch_var} ${dispatch} PARENT_SCOPE)
endfunction()
