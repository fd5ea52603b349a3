/* cblas_sgemm for MLX, with products of a few rows (or one column) sent to cblas_sgemv.
 *
 * MLX's CPU backend runs every matrix product through cblas_sgemm, row-major. OpenBLAS's sgemm
 * packs its operands into blocks before it multiplies; for a product with one row (a lone
 * sequence's decode step: every linear layer and the output head against one token) the packing
 * costs more than the product: 237 us against sgemv's 62 us for a 1376 x 512 weight on a 2-core
 * AMD EPYC. Preloaded before OpenBLAS (gateway/blas.py), this library takes MLX's calls: a product
 * with at most FEW_ROWS rows goes to the next library's cblas_sgemv once per row, one with a single
 * column to one sgemv, every other one to its cblas_sgemm (both found with RTLD_NEXT: the BLAS
 * preloaded after this one, else MLX's own). Each row's sgemv reads the weight again; up to four
 * rows that still beat sgemm's packing (decode steps of 2 / 3 / 4 / 6 / 8 rows measured 1.36 /
 * 1.29 / 1.23 / 1.06 / 0.91x faster on that machine).
 *
 * Row-major C (m x n, ldc) = alpha op(A) (m x k) op(B) (k x n) + beta C, so:
 *   row r of C = alpha op(B)^T a_r + beta (row r of C), where a_r is A's row r (stride 1) or, for a
 *                transposed A (k x m), its column r (stride lda); op(B)^T is B read transposed (B
 *                is k x n) or as it is (B is n x k);
 *   n == 1:      C's column (stride ldc) = alpha op(A) b + beta C's column, likewise.
 * With beta == 0 the output is zeroed first: it may hold any bits (MLX does not clear it), so the
 * result never depends on whether the BLAS's sgemv skips or multiplies the old values then. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, FEW_ROWS = 4 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

int strata_vector_products = 1;       /* 0: every product goes to the next sgemm (benchmarks switch it) */
long strata_num_vector_products = 0;  /* products sent to sgemv (tests read it) */

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

static void find_next(void)
{
    next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
}

static void zero(float *y, int count, int stride)
{
    for (int i = 0; i < count; i++)
        y[(size_t)i * stride] = 0.0f;
}

/* Row r of C (n floats from c_row) from row r of op(A). */
static void row_product(int trans_a, int trans_b, int n, int k, float alpha, const float *a, int lda, int r,
                        const float *b, int ldb, float beta, float *c_row)
{
    const float *a_row = trans_a == NO_TRANS ? a + (size_t)r * lda : a + r;
    int stride_a = trans_a == NO_TRANS ? 1 : lda;
    if (beta == 0.0f)
        zero(c_row, n, 1);
    if (trans_b == NO_TRANS)
        next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a_row, stride_a, beta, c_row, 1);
    else
        next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a_row, stride_a, beta, c_row, 1);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc)
{
    if (next_sgemm == NULL)
        find_next();  /* a race between threads writes the same pointers */
    int vector = strata_vector_products && next_sgemv != NULL && order == ROW_MAJOR && k > 0 && (m <= FEW_ROWS || n == 1);
    if (!vector) {
        next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    __atomic_fetch_add(&strata_num_vector_products, 1, __ATOMIC_RELAXED);
    if (m <= FEW_ROWS) {
        for (int r = 0; r < m; r++)
            row_product(trans_a, trans_b, n, k, alpha, a, lda, r, b, ldb, beta, c + (size_t)r * ldc);
        return;
    }
    if (beta == 0.0f)
        zero(c, m, ldc);
    int stride_b = trans_b == NO_TRANS ? ldb : 1;
    if (trans_a == NO_TRANS)
        next_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, stride_b, beta, c, ldc);
    else
        next_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, stride_b, beta, c, ldc);
}
