// cuda_runtime.h of the fake device: the runtime API subset (cuda_runtime_api.h).
#pragma once
#include "cuda_runtime_api.h"
