// The NEON kernel set compiled again with the ARMv8.2 dot-product extension (-march=armv8.2-a+dotprod):
// its integer score dots use sdot. oscar_core.cc picks it at run time where the CPU reports the
// extension (Cortex-A55/A75 and later; not Cortex-A53/A72), and the plain NEON set elsewhere.
#if !defined(__ARM_FEATURE_DOTPROD)
#error "oscar_neon_dotprod.cc must be compiled with -march=armv8.2-a+dotprod"
#endif
#define OSCAR_NEON_KERNELS kNeonDotprodKernels
#include "oscar_neon.cc"
