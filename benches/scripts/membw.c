/* Read bandwidth of this machine: N threads each stream their share of a
 * 256 MiB buffer five times with 256-bit loads; prints GB/s per try.
 *   gcc -O2 -mavx2 -pthread benches/scripts/membw.c -o /tmp/membw && /tmp/membw 2
 * The engine's decode reads every weight once per token, so this is its
 * roofline (benches/RESULTS.md section 5). */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N (256UL << 20)
static char *buf;
static int nt;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *a) {
    long id = (long)a;
    size_t per = N / nt;
    __m256i acc = _mm256_setzero_si256();
    for (int rep = 0; rep < 5; rep++)
        for (size_t i = id * per; i < (id + 1) * per; i += 64) {
            acc = _mm256_add_epi64(acc, _mm256_load_si256((__m256i *)(buf + i)));
            acc = _mm256_add_epi64(acc, _mm256_load_si256((__m256i *)(buf + i + 32)));
        }
    return (void *)(long)_mm256_extract_epi64(acc, 0);
}

int main(int argc, char **argv) {
    nt = argc > 1 ? atoi(argv[1]) : 1;
    if (nt < 1 || nt > 64) return 2;
    buf = aligned_alloc(64, N);
    if (!buf) return 1;
    for (size_t i = 0; i < N; i++) buf[i] = (char)i;
    for (int k = 0; k < 3; k++) {
        pthread_t th[64];
        double t = now();
        for (long i = 0; i < nt; i++) pthread_create(&th[i], 0, run, (void *)i);
        for (int i = 0; i < nt; i++) pthread_join(th[i], 0);
        printf("%d threads: %.1f GB/s\n", nt, 5.0 * N / (now() - t) / 1e9);
    }
    free(buf);
    return 0;
}
