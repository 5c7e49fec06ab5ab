// host_device.hpp: one macro that lets element math compile for CPU and GPU alike.
#pragma once

#if defined(__CUDACC__)
#define SHARDOPT_HD __host__ __device__ __forceinline__
#else
#define SHARDOPT_HD inline
#endif
