/* How the C products split a weight's rows between OpenMP threads (small_matmul.c, int4_matmul.c). */
#ifndef KVFERRY_ROW_SHARES_H
#define KVFERRY_ROW_SHARES_H

#include <omp.h>
#include <stdint.h>

/* This thread's share of n rows: one contiguous run, starting at a multiple of `multiple` (its blocks' alignment),
 * the last share ending at n. Called inside a parallel region; the same split for the same n and thread count. */
static inline void my_share(int n, int multiple, int *first, int *last) {
    int threads = omp_get_num_threads(), me = omp_get_thread_num();
    int groups = (n + multiple - 1) / multiple;
    *first = (int)((int64_t)groups * me / threads) * multiple;
    *last = (int)((int64_t)groups * (me + 1) / threads) * multiple;
    *last = *last < n ? *last : n;
}

#endif
