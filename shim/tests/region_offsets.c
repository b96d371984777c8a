/* Prints the shared region's layout as the C compiler sees it, one "NAME OFFSET SIZE" per line,
 * for tests/shim/test_shared_region.py to compare with the Python mirror. */
#include "../region_layout.h"

#include <stddef.h>
#include <stdio.h>

#define F(type, field) \
    printf("%s.%s %zu %zu\n", #type, #field, offsetof(struct type, field), sizeof(((struct type *)0)->field))
#define S(type) printf("%s %zu %zu\n", #type, (size_t)0, sizeof(struct type))

int main(void)
{
    S(tessera_region_header);
    F(tessera_region_header, magic);
    F(tessera_region_header, version);
    F(tessera_region_header, header_size);
    F(tessera_region_header, region_size);
    F(tessera_region_header, max_devices);
    F(tessera_region_header, max_procs);
    F(tessera_region_header, proc_hwm);
    F(tessera_region_header, hold_mask);
    F(tessera_region_header, created_unix_ns);
    F(tessera_region_header, hold_until_ns);
    F(tessera_region_header, _reserved);
    S(tessera_region_device);
    F(tessera_region_device, mem_limit_bytes);
    F(tessera_region_device, card_total_bytes);
    F(tessera_region_device, core_limit_pct);
    F(tessera_region_device, _pad0);
    F(tessera_region_device, launches);
    S(tessera_region_proc);
    F(tessera_region_proc, pid);
    F(tessera_region_proc, reaper);
    F(tessera_region_proc, start_time);
    F(tessera_region_proc, used);
    F(tessera_region_proc, spill_busy);
    F(tessera_region_proc, spill_gen);
    F(tessera_region_proc, _reserved);
    F(tessera_region_proc, spilled);
    S(tessera_region);
    F(tessera_region, hdr);
    F(tessera_region, dev);
    F(tessera_region, proc);
    printf("const.TESSERA_REGION_MAGIC %llu 8\n", (unsigned long long)TESSERA_REGION_MAGIC);
    printf("const.TESSERA_REGION_VERSION %u 4\n", TESSERA_REGION_VERSION);
    printf("const.TESSERA_MAX_DEVICES %u 4\n", TESSERA_MAX_DEVICES);
    printf("const.TESSERA_MAX_PROCS %u 4\n", TESSERA_MAX_PROCS);
    return 0;
}
