// hscapture's fp8 kernel: the CUDA twin of `fp8::quantize` (see fp8.rs for the exact semantics, which this
// file must match bit for bit). Compiled with capture.cu (appended to it: it uses that file's typedefs and
// `load`), after a step's last captured layer, over the device arena.
//
// One block per captured row d; threads stride over that row's slots × hidden values, read from the arena
// (`[slot][capacity][width]` in the output dtype):
//   amax   = max |v| over the row (NaN if any value is NaN)
//   scale  = amax / 448 (IEEE), at least 1e-12 (a NaN stays NaN)
//   code   = e4m3fn(v / scale)  (IEEE division; round to nearest even, not saturating: NaN from 464 up)
// Codes go to `codes` in the arena's layout (one byte per value); the scale to `scales[d]`.

typedef unsigned char u8;

__device__ __forceinline__ u8 e4m3_from_f32(float f) {
    const u32 FP8_MAX_BITS = 1087u << 20;  // 480.0: from here on the result is NaN
    const u32 DENORM_MASK = 141u << 23;
    u32 bits = __float_as_uint(f);
    const u32 sign = bits & 0x80000000u;
    bits ^= sign;
    u8 result;
    if (bits >= FP8_MAX_BITS) {
        result = 0x7f;
    } else if (bits < (121u << 23)) {
        // Below 2^-6: e4m3's denormals, rounded by one f32 addition (round to nearest even).
        const u32 sum = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(DENORM_MASK)));
        result = (u8)(sum - DENORM_MASK);
    } else {
        const u32 mant_odd = (bits >> 20) & 1u;
        bits += ((u32)(7 - 127) << 23) + 0x7FFFFu;
        bits += mant_odd;
        result = (u8)(bits >> 20);
    }
    return result | (u8)(sign >> 24);
}

extern "C" __global__ void hscapture_fp8_quantize(
    const void* arena, int dt, i64 slot_stride, int slots, int n_rows, int width,
    u8* codes, float* scales)
{
    const int d = blockIdx.x;
    if (d >= n_rows) return;
    const int per_row = slots * width;
    float amax = 0.0f;
    u32 nan = 0;
    for (int i = threadIdx.x; i < per_row; i += blockDim.x) {
        const int s = i / width, j = i - s * width;
        const float a = fabsf(load(arena, (i64)s * slot_stride + (i64)d * width + j, dt));
        if (a != a) nan = 1u;
        else if (a > amax) amax = a;
    }
    // Block reduction (max and NaN flag): warp shuffles, then one value per warp through shared memory.
    for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_down_sync(0xffffffffu, amax, o));
        nan |= __shfl_down_sync(0xffffffffu, nan, o);
    }
    __shared__ float wmax[32];
    __shared__ u32 wnan[32];
    __shared__ float row_scale;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) { wmax[warp] = amax; wnan[warp] = nan; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        u32 n = 0;
        for (int w = 0; w < nwarps; ++w) { m = fmaxf(m, wmax[w]); n |= wnan[w]; }
        float s = n ? __uint_as_float(0x7fc00000u) : __fdiv_rn(m, 448.0f);
        if (s < 1e-12f) s = 1e-12f;
        row_scale = s;
        scales[d] = s;
    }
    __syncthreads();
    const float s = row_scale;
    for (int i = threadIdx.x; i < per_row; i += blockDim.x) {
        const int sl = i / width, j = i - sl * width;
        const i64 at = (i64)sl * slot_stride + (i64)d * width + j;
        codes[at] = e4m3_from_f32(__fdiv_rn(load(arena, at, dt), s));
    }
}
