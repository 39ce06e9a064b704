/* One pass per update: SGD, Adam and AdamW on dense float32 CPU tensors, with the
 * word sums of each tensor as the update reads it and as it writes it.
 *
 * The arithmetic is that of torch's eager CPU kernels, operation by operation, so the
 * update is bit for bit what optimizer.step() computes: ATen's vectorized add with alpha,
 * lerp and addcmul round once through a fused multiply-add (and so must we: fmaf, with
 * contraction off everywhere else), and its float32 sqrt is MKL's vsSqrt, which is not
 * correctly rounded, so the caller hands in that very function. torch's fused=True CPU
 * kernel for Adam and AdamW does the same arithmetic with a correctly rounded sqrt, except
 * in its scalar tails (see tv_group). A group may instead ask for the arithmetic of
 * torch.compile(optimizer.step) on the CPU (`compiled`): the operations inductor's C++
 * emits for the optimizer's traced step, with a correctly rounded sqrt, scalars computed
 * in float as the graph computes them, and multiply-adds only where it emits fmadd.
 * The Python side checks
 * the claim against the optimizer itself before it uses this file (a CPU, a torch build
 * or an MKL whose results differ sends it back to the compiled update).
 *
 * Each tensor is processed in blocks that stay in the first-level cache: the old words
 * are summed, the update runs, the new words are summed, all while the block is there,
 * so memory is read and written once. Word sums are modulo 2**32 (unsigned wrap-around,
 * the same bits as the int32 sums of torchverity.training._fused.word_sum). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 1024

typedef void (*vsqrt_fn)(int n, const float *in, float *out);

typedef struct {
    float *p;
    const float *g;     /* NULL: the parameter has no gradient, the update skips it */
    float *m;           /* SGD: the momentum buffer (or NULL); Adam: exp_avg */
    float *v;           /* Adam: exp_avg_sq */
    float *vmax;        /* Adam with amsgrad: max_exp_avg_sq */
    float *step;        /* Adam: the step counter (a 0-dim float32 tensor) */
    int64_t n;
    int32_t slot[5];    /* where the sums of p, m, v, vmax, step go (-1: none) */
    int32_t group;
    /* filled by tv_prepare: the step-dependent scalars, as torch rounds them to float
     * (compiled: the divisor and the addend of sqrt(v) in the denominator) */
    float neg_step_size;
    float bc2_sqrt;
} tv_item;

typedef struct {
    int32_t adam;       /* 0: SGD, 1: Adam or AdamW */
    int32_t maximize, has_wd, decoupled, amsgrad, lerp_small, has_momentum, nesterov;
    int32_t compiled;   /* the arithmetic of torch.compile(optimizer.step), not eager's */
    float p_mul;        /* 1 - lr * weight_decay (decoupled; compiled: tv_prepare sets it) */
    float wd;           /* weight_decay (added to the gradient) */
    float w1;           /* 1 - beta1: the lerp weight */
    float w1_minus_1;   /* compiled: (1 - beta1) - 1, the other branch's coefficient */
    float beta1f, lrf;  /* compiled: beta1 and lr as the graph holds them */
    float beta2, c2;    /* beta2, 1 - beta2 */
    float eps;
    float momentum, one_minus_dampening, neg_lr;
    double lr, beta1, beta2d;
    vsqrt_fn sqrt;      /* MKL's vsSqrt (the eager ops), or tv_sqrt (fused=True kernels) */
    /* fused=True: torch's kernel runs a tensor's last (n mod `vector`) elements through
     * its scalar loop, which rounds Adam's second moment and SGD's momentum in another
     * order (see scalar_from). 0: eager, no tail. */
    int64_t vector;
} tv_group;

/* A correctly rounded float32 sqrt of a block: what torch's fused=True CPU kernels take
 * (ATen's vectorized sqrt), where its eager sqrt is MKL's. */
void tv_sqrt(int n, const float *in, float *out) {
    for (int i = 0; i < n; i++) out[i] = sqrtf(in[i]);
}

static uint32_t word_sum(const float *x, int64_t n) {
    const uint32_t *w = (const uint32_t *)x;
    uint32_t s = 0;
    for (int64_t i = 0; i < n; i++) s += w[i];
    return s;
}

static void add_sum(uint32_t *sums, int32_t slot, const float *x, int64_t n) {
    if (slot >= 0 && x != 0) sums[slot] += word_sum(x, n);
}

/* The step counters and the scalars that depend on them, once per update, before the
 * element passes (which several threads may share). The step's sums are taken here. */
/* The compiled graph's scalars: float arithmetic on the step counter, lr and betas. */
static void compiled_scalars(const tv_group *gr, tv_item *it) {
    float step = *it->step;
    float bc1 = 1.0f - powf(gr->beta1f, step);
    float bc2 = 1.0f - powf(gr->beta2, step);
    float neg_step_size = -(gr->lrf / bc1);
    it->neg_step_size = sqrtf(bc2) * neg_step_size;
    it->bc2_sqrt = (1.0f / neg_step_size) * gr->eps;
}

void tv_prepare(tv_item *items, int64_t count, tv_group *groups, int64_t group_count,
                uint32_t *old_sums, uint32_t *new_sums) {
    for (int64_t k = 0; k < group_count; k++)
        if (groups[k].compiled) groups[k].p_mul = 1.0f - groups[k].lrf * groups[k].wd;
    for (int64_t k = 0; k < count; k++) {
        tv_item *it = &items[k];
        const tv_group *gr = &groups[it->group];
        if (!gr->adam || it->step == 0) continue;
        add_sum(old_sums, it->slot[4], it->step, 1);
        if (it->g != 0) *it->step = *it->step + 1.0f;  /* no gradient: the update skips it */
        add_sum(new_sums, it->slot[4], it->step, 1);
        if (it->g == 0) continue;
        if (gr->compiled) {
            compiled_scalars(gr, it);
            continue;
        }
        double step = (double)*it->step;
        double bc1 = 1.0 - pow(gr->beta1, step);
        double bc2 = 1.0 - pow(gr->beta2d, step);
        double step_size = gr->lr / bc1;
        it->neg_step_size = (float)(-step_size);
        it->bc2_sqrt = (float)pow(bc2, 0.5);
    }
}

/* torch.maximum's vector kernel: the larger value, or a NaN of all ones bits. */
static inline float maximum(float a, float b) {
    if (a != a || b != b) {
        union { uint32_t u; float f; } nan = {0xFFFFFFFFu};
        return nan.f;
    }
    return a > b ? a : b;
}

/* Where the scalar arithmetic of torch's fused=True kernel starts in a tensor of n
 * elements (n: none). Its vector loop stops at the last multiple of `vector`; the
 * compiler vectorizes the scalar loop after it 8 floats at a time, and those 8 round as
 * the vector loop does, so on AVX-512 (vector 16) a tail of 8 or more begins with 8
 * elements of vector arithmetic. */
static int64_t scalar_from(const tv_group *gr, int64_t n) {
    if (gr->vector == 0) return n;
    int64_t a = n - n % gr->vector;
    return a + (n - a) / 8 * 8;
}

/* torch's fused kernel rounds the second moment of its scalar elements in another order:
 * redo those that fall in the block [lo, lo + nb) of a tensor of n elements, from the old
 * values in `old`. */
static void scalar_tail(const tv_group *gr, int64_t n, int64_t lo, int64_t nb,
                        const float *old, const float *grad, float *v) {
    int64_t a = scalar_from(gr, n);
    for (int64_t j = a > lo ? a : lo; j < lo + nb; j++) {
        int64_t i = j - lo;
        v[i] = fmaf(old[i], gr->beta2, (gr->c2 * grad[i]) * grad[i]);
    }
}

static void adam_block(const tv_group *gr, const tv_item *it, int64_t lo, int64_t nb) {
    float grad[BLOCK], denom[BLOCK];
    float *p = it->p + lo, *m = it->m + lo, *v = it->v + lo;
    const float *g = it->g + lo;
    for (int64_t i = 0; i < nb; i++) {
        float gi = gr->maximize ? -g[i] : g[i];
        if (gr->has_wd && !gr->decoupled) gi = fmaf(p[i], gr->wd, gi);
        grad[i] = gi;
    }
    if (gr->has_wd && gr->decoupled)
        for (int64_t i = 0; i < nb; i++) p[i] = p[i] * gr->p_mul;
    if (gr->lerp_small) {
        for (int64_t i = 0; i < nb; i++) m[i] = fmaf(gr->w1, grad[i] - m[i], m[i]);
    } else {
        float coeff = gr->w1 - 1.0f;
        for (int64_t i = 0; i < nb; i++) m[i] = fmaf(coeff, grad[i] - m[i], grad[i]);
    }
    float old_v[BLOCK];
    int tail = lo + nb > scalar_from(gr, it->n);
    if (tail) memcpy(old_v, v, (size_t)nb * sizeof(float));
    for (int64_t i = 0; i < nb; i++) {
        float t = v[i] * gr->beta2;
        v[i] = fmaf(gr->c2 * grad[i], grad[i], t);
    }
    if (tail) scalar_tail(gr, it->n, lo, nb, old_v, grad, v);
    const float *second = v;
    if (gr->amsgrad) {
        float *vm = it->vmax + lo;
        for (int64_t i = 0; i < nb; i++) vm[i] = maximum(vm[i], v[i]);
        second = vm;
    }
    gr->sqrt((int)nb, second, denom);
    float bc2_sqrt = it->bc2_sqrt, eps = gr->eps, neg_step = it->neg_step_size;
    for (int64_t i = 0; i < nb; i++) denom[i] = denom[i] / bc2_sqrt + eps;
    for (int64_t i = 0; i < nb; i++) p[i] = p[i] + (neg_step * m[i]) / denom[i];
}

/* SGD on the elements [lo, hi) of a tensor; `scalar`: the momentum as the scalar loop of
 * torch's fused=True kernel rounds it (the multiply-add on the old buffer). */
static void sgd_range(const tv_group *gr, const tv_item *it, int64_t lo, int64_t hi,
                      int scalar) {
    float *p = it->p, *buf = it->m;
    const float *g = it->g;
    for (int64_t i = lo; i < hi; i++) {
        float gi = gr->maximize ? -g[i] : g[i];
        if (gr->has_wd) gi = fmaf(p[i], gr->wd, gi);
        if (buf) {
            float b = scalar ? fmaf(buf[i], gr->momentum, gi * gr->one_minus_dampening)
                             : fmaf(gi, gr->one_minus_dampening, buf[i] * gr->momentum);
            buf[i] = b;
            gi = gr->nesterov ? fmaf(b, gr->momentum, gi) : b;
        }
        p[i] = fmaf(gi, gr->neg_lr, p[i]);
    }
}

static void sgd_block(const tv_group *gr, const tv_item *it, int64_t lo, int64_t nb) {
    int64_t hi = lo + nb, a = scalar_from(gr, it->n);
    if (a < lo) a = lo;
    if (a > hi) a = hi;
    sgd_range(gr, it, lo, a, 0);
    sgd_range(gr, it, a, hi, 1);
}

/* Adam and AdamW as inductor's C++ computes them: separate roundings where eager fuses
 * (lerp, weight decay), one fmadd for the second moment, and the denominator as
 * sqrt(v) / (sqrt(bc2) * -step_size) + eps / -step_size. */
static void adam_block_compiled(const tv_group *gr, const tv_item *it, int64_t lo,
                                int64_t nb) {
    float grad[BLOCK], denom[BLOCK];
    float *p = it->p + lo, *m = it->m + lo, *v = it->v + lo;
    const float *g = it->g + lo;
    for (int64_t i = 0; i < nb; i++) {
        float gi = gr->maximize ? -g[i] : g[i];
        if (gr->has_wd && !gr->decoupled) gi = gi + p[i] * gr->wd;
        grad[i] = gi;
    }
    if (gr->lerp_small) {
        for (int64_t i = 0; i < nb; i++) m[i] = m[i] + (grad[i] - m[i]) * gr->w1;
    } else {
        for (int64_t i = 0; i < nb; i++) m[i] = grad[i] + (grad[i] - m[i]) * gr->w1_minus_1;
    }
    for (int64_t i = 0; i < nb; i++)
        v[i] = fmaf(grad[i] * grad[i], gr->c2, v[i] * gr->beta2);
    const float *second = v;
    if (gr->amsgrad) {
        float *vm = it->vmax + lo;
        for (int64_t i = 0; i < nb; i++) vm[i] = maximum(vm[i], v[i]);
        second = vm;
    }
    tv_sqrt((int)nb, second, denom);
    float div = it->neg_step_size, add = it->bc2_sqrt;
    for (int64_t i = 0; i < nb; i++) denom[i] = denom[i] / div + add;
    if (gr->has_wd && gr->decoupled)
        for (int64_t i = 0; i < nb; i++) p[i] = p[i] * gr->p_mul + m[i] / denom[i];
    else
        for (int64_t i = 0; i < nb; i++) p[i] = p[i] + m[i] / denom[i];
}

static void sgd_block_compiled(const tv_group *gr, const tv_item *it, int64_t lo,
                               int64_t nb) {
    float *p = it->p + lo, *buf = it->m ? it->m + lo : 0;
    const float *g = it->g + lo;
    for (int64_t i = 0; i < nb; i++) {
        float gi = gr->maximize ? -g[i] : g[i];
        if (gr->has_wd) gi = gi + p[i] * gr->wd;
        if (buf) {
            float b = buf[i] * gr->momentum + gi * gr->one_minus_dampening;
            buf[i] = b;
            gi = gr->nesterov ? gi + b * gr->momentum : b;
        }
        p[i] = fmaf(gi, gr->neg_lr, p[i]);
    }
}

/* The elements [lo, hi) of the items laid end to end: several threads may each take a
 * range (their sums are added afterwards). tv_prepare must have run for this update. */
void tv_run(const tv_item *items, int64_t count, const tv_group *groups, int64_t lo,
            int64_t hi, uint32_t *old_sums, uint32_t *new_sums) {
    int64_t base = 0;
    for (int64_t k = 0; k < count && base < hi; base += items[k].n, k++) {
        const tv_item *it = &items[k];
        int64_t a = lo > base ? lo - base : 0;
        int64_t b = hi - base < it->n ? hi - base : it->n;
        const tv_group *gr = &groups[it->group];
        for (int64_t start = a; start < b; start += BLOCK) {
            int64_t nb = b - start < BLOCK ? b - start : BLOCK;
            float *ts[4] = {it->p, it->m, it->v, it->vmax};
            for (int j = 0; j < 4; j++)
                if (ts[j]) add_sum(old_sums, it->slot[j], ts[j] + start, nb);
            if (it->g != 0) {
                if (gr->compiled) {
                    if (gr->adam) adam_block_compiled(gr, it, start, nb);
                    else sgd_block_compiled(gr, it, start, nb);
                } else if (gr->adam) {
                    adam_block(gr, it, start, nb);
                } else {
                    sgd_block(gr, it, start, nb);
                }
            }
            for (int j = 0; j < 4; j++)
                if (ts[j]) add_sum(new_sums, it->slot[j], ts[j] + start, nb);
        }
    }
}
