# Sourced by the run scripts: the widest OpenBLAS kernels this CPU runs.
# Debian 12's OpenBLAS 0.3.21 falls back to its SSE3 kernels on CPUs newer
# than it knows (Sapphire/Emerald Rapids), 2-3x slower in sgemm (prefill,
# k-means, graph builds). It reads OPENBLAS_CORETYPE when it loads, so the
# variable must be in the environment before a test or tool starts; a value
# the user set is kept. (The C++ tools also re-execute themselves with it:
# benchmarks/blas_kernels.h.)
if [ -z "${OPENBLAS_CORETYPE:-}" ] && [ -r /proc/cpuinfo ]; then
  _kv_flags=$(grep -m1 '^flags' /proc/cpuinfo)
  _kv_has() { case " $_kv_flags " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
  if _kv_has avx512f && _kv_has avx512bw && _kv_has avx512dq && _kv_has avx512vl && _kv_has avx512cd; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif _kv_has avx2 && _kv_has fma; then
    export OPENBLAS_CORETYPE=Haswell
  fi
  unset -f _kv_has
  unset _kv_flags
fi
