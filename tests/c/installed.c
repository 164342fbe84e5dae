/*
 * A program built against an installed slotpool, the way a user builds one:
 *
 *   cc installed.c $(pkg-config --cflags --libs slotpool)
 *
 * scripts/test-install.sh builds and runs it (on the sim backend) after scripts/install.sh.
 * Prints "installed: ok ..." and exits 0 when the library it loaded is the one of the header.
 */
#include <slotpool.h>

#include <stdio.h>
#include <string.h>

int main(void) {
    int major = -1, minor = -1, patch = -1;
    if (sp_version(&major, &minor, &patch) != SP_OK || major != SP_VERSION_MAJOR ||
        minor != SP_VERSION_MINOR || patch != SP_VERSION_PATCH) {
        fprintf(stderr, "library %d.%d.%d, header %d.%d.%d\n", major, minor, patch,
                SP_VERSION_MAJOR, SP_VERSION_MINOR, SP_VERSION_PATCH);
        return 1;
    }
    void* p = NULL;
    sp_status s = sp_alloc(0, 1 << 20, 0, &p);
    if (s != SP_OK) {
        fprintf(stderr, "sp_alloc: %s: %s\n", sp_status_name(s), sp_last_error_message());
        return 1;
    }
    s = sp_free(p);
    sp_status twice = sp_free(p);
    if (s != SP_OK || strcmp(sp_status_name(twice), "SP_ERR_UNKNOWN_POINTER") != 0) {
        fprintf(stderr, "sp_free: %s, then %s\n", sp_status_name(s), sp_status_name(twice));
        return 1;
    }
    printf("installed: ok, slotpool %d.%d.%d, a double free is %s\n", major, minor, patch,
           sp_status_name(twice));
    return 0;
}
