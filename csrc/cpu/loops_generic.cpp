// The per-token loops for any CPU (the compiler's baseline instruction set).
#define VCPO_ISA generic
#include "token_loops_impl.h"
