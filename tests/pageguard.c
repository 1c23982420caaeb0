/* A guard-page allocator for the hostile-file tests (tests/guarded.py).

   Loaded with LD_PRELOAD into a child process that replays hostile trace
   files, it gives every aligned allocation -- posix_memalign, aligned_alloc,
   memalign, valloc, pvalloc: how torch's CPU allocator (c10::alloc_cpu) and
   oneDNN get the memory of every tensor -- its own mapping, placed so that
   the block ends where an inaccessible page begins.  A kernel that reads or
   writes past the end of a tensor's memory by more than the alignment's
   slack touches that page and the process dies of SIGSEGV, however little
   it overran; with PAGEGUARD_BELOW=1 the block starts right after an
   inaccessible page instead, so that an underrun (a negative index) dies.
   The slack on the other side (up to 63 bytes after the end, or the rest of
   the last page below) is filled with a pattern checked when the block is
   freed: a write there aborts with a message on stderr.

   Why not Debian's electric-fence: it guards every malloc, and importing
   torch makes hundreds of thousands of small C++ allocations, each its own
   mapping, past the kernel's vm.max_map_count (65530): efence exits with
   "mprotect() failed" before torch has loaded.  Only aligned allocations --
   the data of tensors -- come here; plain malloc stays glibc's.

   With PAGEGUARD_EXACT=1 the block ends exactly at the inaccessible page,
   its start aligned only as far as its size allows (at most 16 bytes):
   torch's kernels load unaligned, and a read one element past a small
   tensor (a statistic per channel given for fewer channels) faults too.

   Limits: a read (not a write) within the slack is not seen; memory freed
   is unmapped, so a use after free is seen only while nothing was mapped
   there since.  Build: cc -shared -fPIC -O2 -o pageguard.so pageguard.c -ldl
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS (1u << 20) /* live guarded blocks at most; then plain mmap fails with ENOMEM */
#define PATTERN 0xA5

struct block {
    uintptr_t ptr;  /* what the caller got; 0: empty slot, 1: deleted */
    uintptr_t base; /* the mapping */
    size_t length;  /* of the mapping */
    size_t size;    /* what the caller asked for */
};

static struct block table[SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t page;
static int below = -1;
static int exact = 0;
static void (*real_free)(void *);
static void *(*real_realloc)(void *, size_t);
static size_t (*real_usable)(void *);

static void init(void) {
    if (below >= 0) return;
    page = (size_t)sysconf(_SC_PAGESIZE);
    const char *b = getenv("PAGEGUARD_BELOW");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    real_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
    real_usable = (size_t(*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    const char *e = getenv("PAGEGUARD_EXACT");
    exact = e != NULL && e[0] == '1';
    below = b != NULL && b[0] == '1';
}

static size_t slot_of(uintptr_t p) { return (size_t)((p >> 4) * 0x9E3779B97F4A7C15ull >> 44) & (SLOTS - 1); }

static void report(const char *what, const struct block *b) {
    char msg[200];
    int n = snprintf(msg, sizeof msg, "pageguard: %s a block of %zu bytes at %p\n", what, b->size, (void *)b->ptr);
    if (n > 0) (void)!write(2, msg, (size_t)n);
    abort();
}

static void *guarded(size_t align, size_t size) {
    init();
    if (align < sizeof(void *)) align = sizeof(void *);
    if (align > page) return NULL; /* not needed by torch; refuse rather than misplace */
    if (exact && !below) { /* end exactly at the guard: the start only as aligned as the size allows */
        size_t natural = size & -size;
        if (natural == 0 || natural > 16) natural = 16;
        if (natural < align) align = natural;
    }
    size_t rounded = (size + align - 1) / align * align;
    size_t data = (rounded + page - 1) / page * page;
    if (data == 0) data = page;
    size_t length = data + page;
    char *base = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    char *ptr;
    if (below) { /* [guard][data ... slack] */
        mprotect(base, page, PROT_NONE);
        ptr = base + page;
        memset(ptr + size, PATTERN, data - size);
    } else { /* [slack ... data][guard] */
        mprotect(base + data, page, PROT_NONE);
        ptr = base + data - rounded;
        memset(base, PATTERN, (size_t)(ptr - base));
        memset(ptr + size, PATTERN, rounded - size);
    }
    pthread_mutex_lock(&lock);
    size_t i = slot_of((uintptr_t)ptr);
    for (size_t k = 0; k < SLOTS && table[i].ptr > 1; k++) i = (i + 1) & (SLOTS - 1);
    if (table[i].ptr > 1) {
        pthread_mutex_unlock(&lock);
        munmap(base, length);
        return NULL;
    }
    table[i] = (struct block){(uintptr_t)ptr, (uintptr_t)base, length, size};
    pthread_mutex_unlock(&lock);
    return ptr;
}

/* Remove ``p`` from the table into ``out``; 0 if it is not a guarded block. */
static int take(void *p, struct block *out) {
    if (p == NULL) return 0;
    init();
    uintptr_t key = (uintptr_t)p;
    pthread_mutex_lock(&lock);
    size_t i = slot_of(key);
    for (size_t k = 0; k < SLOTS && table[i].ptr != 0; k++, i = (i + 1) & (SLOTS - 1)) {
        if (table[i].ptr == key) {
            *out = table[i];
            table[i].ptr = 1;
            pthread_mutex_unlock(&lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static int find(void *p, struct block *out) {
    if (!take(p, out)) return 0;
    pthread_mutex_lock(&lock);
    size_t i = slot_of(out->ptr);
    while (table[i].ptr > 1) i = (i + 1) & (SLOTS - 1);
    table[i] = *out;
    pthread_mutex_unlock(&lock);
    return 1;
}

static void check(const struct block *b) {
    const unsigned char *base = (const unsigned char *)b->base, *ptr = (const unsigned char *)b->ptr;
    const unsigned char *end = ptr + b->size;
    const unsigned char *stop = below ? base + b->length : base + b->length - page;
    for (const unsigned char *q = below ? base + page : base; q < ptr; q++)
        if (*q != PATTERN) report("write before", b);
    for (const unsigned char *q = end; q < stop; q++)
        if (*q != PATTERN) report("write past the end of", b);
}

/* At exit, blocks never freed (module-level tensors) get their slack checked too. */
__attribute__((destructor)) static void check_live(void) {
    if (below < 0) return;
    for (size_t i = 0; i < SLOTS; i++)
        if (table[i].ptr > 1) check(&table[i]);
}

void free(void *p) {
    struct block b;
    if (take(p, &b)) {
        check(&b);
        munmap((void *)b.base, b.length);
        return;
    }
    init();
    real_free(p);
}

void *realloc(void *p, size_t size) {
    struct block b;
    if (!find(p, &b)) {
        init();
        return real_realloc(p, size);
    }
    void *q = guarded(16, size);
    if (q == NULL) return NULL;
    memcpy(q, p, b.size < size ? b.size : size);
    free(p);
    return q;
}

size_t malloc_usable_size(void *p) {
    struct block b;
    if (find(p, &b)) return b.size;
    init();
    return real_usable(p);
}

int posix_memalign(void **out, size_t align, size_t size) {
    if (align == 0 || (align & (align - 1)) != 0 || align % sizeof(void *) != 0) return EINVAL;
    void *p = guarded(align, size);
    if (p == NULL) return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t align, size_t size) {
    void *p = guarded(align, size);
    if (p == NULL) errno = ENOMEM;
    return p;
}

void *memalign(size_t align, size_t size) { return aligned_alloc(align, size); }
void *valloc(size_t size) { return aligned_alloc(sysconf(_SC_PAGESIZE), size); }
void *pvalloc(size_t size) { return aligned_alloc(sysconf(_SC_PAGESIZE), size); }
