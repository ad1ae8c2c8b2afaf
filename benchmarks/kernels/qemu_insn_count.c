/* A qemu TCG plugin that counts the guest instructions a program executes and prints
 * "instructions N" to stderr at exit: benchmarks/kernels/neon_instructions.sh uses it to compare NEON
 * kernel builds where no arm64 CPU is at hand. Debian's qemu-user runs plugins but ships no
 * plugin header, so the few entry points used (plugin API version 1, qemu 7.x and 8.x) are
 * declared here. Build: gcc -shared -fPIC -O2 -o qemu_insn_count.so qemu_insn_count.c */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
enum { kInlineAddU64 = 0 }; /* QEMU_PLUGIN_INLINE_ADD_U64 */

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *, int, void *, uint64_t);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, void *), void *);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t executed; /* the benchmark is single-threaded (THREADS 1): one counter suffices */

/* Each translated block adds its instruction count every time it runs. */
static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
  (void)id;
  qemu_plugin_register_vcpu_tb_exec_inline(tb, kInlineAddU64, &executed, qemu_plugin_tb_n_insns(tb));
}

static void on_exit(qemu_plugin_id_t id, void *data) {
  (void)id, (void)data;
  fprintf(stderr, "instructions %llu\n", (unsigned long long)executed);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const void *info, int argc,
                                                               char **argv) {
  (void)info, (void)argc, (void)argv;
  qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
  qemu_plugin_register_atexit_cb(id, on_exit, NULL);
  return 0;
}
